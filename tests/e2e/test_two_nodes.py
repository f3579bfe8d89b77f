"""Two Ray nodes on one machine (two `ray start` on distinct loopback addresses): prefill on
one, decode on the other. KV must cross nodes both ways, via each node's own address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
HEAD, WORKER = "127.0.0.2", "127.0.0.3"
GCS_PORT = 6390


def _start(args: list[str], env: dict) -> subprocess.Popen:
    # --block keeps `ray start` in the foreground; its own process group lets the test
    # end the node and everything it started without touching other Ray clusters here.
    return subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.fixture
def two_nodes():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Nodes and driver agree on no token auth (Ray turns it on for `ray start` when a
    # token file from an earlier local cluster exists).
    env.update(UCX_NET_DEVICES="lo", RAY_AUTH_MODE="disabled")
    head = _start(
        [
            "--head",
            f"--node-ip-address={HEAD}",
            f"--port={GCS_PORT}",
            "--num-cpus=4",
            '--resources={"prefill_pool": 1}',
            "--include-dashboard=false",
        ],
        env,
    )
    time.sleep(8)
    worker = _start(
        [
            f"--address={HEAD}:{GCS_PORT}",
            f"--node-ip-address={WORKER}",
            "--num-cpus=4",
            '--resources={"decode_pool": 1}',
        ],
        env,
    )
    time.sleep(8)
    try:
        yield f"{HEAD}:{GCS_PORT}"
    finally:
        for node in (worker, head):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(node.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(3)
        # `ray start --head` records its address for later `ray`/`serve` commands on this
        # machine; don't leave them pointing at a cluster that is gone.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.exists() and current.read_text().strip() == f"{HEAD}:{GCS_PORT}":
            current.unlink()


@pytest.mark.e2e
def test_two_turns_across_nodes_reuse_kv(two_nodes):
    env = {
        **os.environ,
        "RAY_ADDRESS": two_nodes,
        "UCX_NET_DEVICES": "lo",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": str(REPO),
    }
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.multinode_driver"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    print(json.dumps(report, indent=1))
    prefill, decode = report["prefill"], report["decode"]
    # Each engine advertises its own node's address for its NIXL side channel.
    assert prefill["node_ip"] == HEAD and prefill["side_channel"][0] == HEAD
    assert decode["node_ip"] == WORKER and decode["side_channel"][0] == WORKER
    first, second = report["turns"]
    # P -> D: decode read the prompt from the other node.
    assert decode["prompt_tokens_external"] >= first["prompt_tokens"] - 32
    # D -> P: turn 2's prefill pulled the history from the other node.
    history = first["prompt_tokens"] + first["completion_tokens"] - 1
    assert second["prefill_external"] >= history - 32
    assert second["cached_tokens"] == second["prefill_external"]
    assert second["kvturn"]["reused_from_decode"] > 0
