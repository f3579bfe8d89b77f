"""Engine processes never outlive their replica, and a replica whose engine died is
replaced. Each test runs the app with `serve run` (its own local Ray cluster, in a process
group of its own) and identifies the app's vLLM processes by pid, recorded while it runs:
other engines may be running on this machine.

`ray stop --force` would kill every Ray process of the machine (other tests' clusters
too); here it is done for this cluster only: SIGKILL to every Ray process of the tree,
sparing the vLLM processes, as `ray stop --force` spares them (they are not Ray's).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.helpers import SYSTEM

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SERVE = str(Path(sys.executable).parent / "serve")
GONE_WITHIN_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """`serve run` of a 1 prefill + 1 decode app on a fresh local cluster."""

    def __init__(self, tmp_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = {
            "model": str(REPO / "models" / "tiny-qwen3"),
            "enforce_eager": True,
            "max_model_len": 1024,
            "default_max_tokens": 8,
            "app_name": "lifetime",
            "prefill": {"num_cpus": 0.5, "enable_prefix_caching": False, "kv_cache_memory_bytes": 64 << 20},
            "decode": {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20},
            "transfer": {"kv_buffer_device": "cpu", "recompute_threshold_tokens": 32},
            "env": {"UCX_NET_DEVICES": "lo"},
        }
        config = {
            "http_options": {"host": "127.0.0.1", "port": self.port},
            "applications": [
                {"name": "lifetime", "import_path": "app:graph", "route_prefix": "/", "args": args}
            ],
        }
        path = tmp_path / "serve.json"  # JSON is YAML
        path.write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(UCX_NET_DEVICES="lo", RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO))
        self.log = open(tmp_path / "serve.log", "w")
        self.proc = subprocess.Popen(
            [SERVE, "run", str(path)],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.seen_engines: set[int] = set()
        self.root = psutil.Process(self.proc.pid)
        self.known: dict[int, psutil.Process] = {}

    def wait_healthy(self, timeout_s: float = 420) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve run exited: {self.tail()}"
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    self.tree()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError(f"app not healthy after {timeout_s} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def tree(self) -> list[psutil.Process]:
        """The app's processes: everything below `serve run` now, and below any process of
        it seen before (Ray gives each worker a process group of its own, and a process
        whose parent died is re-parented, so neither the group nor today's tree is enough)."""
        found: dict[int, psutil.Process] = {}
        for root in [self.root, *self.known.values()]:
            try:
                if not root.is_running():  # gone, or its pid now names another process
                    continue
                for p in [root, *root.children(recursive=True)]:
                    found.setdefault(p.pid, p)
            except psutil.Error:
                continue
        for pid, p in found.items():
            self.known.setdefault(pid, p)
        return [p for p in found.values() if p.is_running()]

    def engines(self) -> dict[int, str]:
        """pid -> role of the app's vLLM engine processes now (role from the replica's title)."""
        found = {}
        for p in self.tree():
            try:
                if "VLLM" not in " ".join(p.cmdline()):
                    continue
                parent = " ".join(p.parent().cmdline())
            except psutil.Error:
                continue
            found[p.pid] = (
                "decode" if "DecodeServer" in parent else "prefill" if "PrefillServer" in parent else "?"
            )
        self.seen_engines |= set(found)
        return found

    def turn(self, text: str) -> dict:
        body = {
            "model": "tiny-qwen3",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": 8,
            "temperature": 0,
        }
        r = httpx.post(
            self.url + "/v1/chat/completions", json=body, headers={"x-session-id": "lifetime"}, timeout=120
        )
        assert r.status_code == 200, r.text
        return r.json()

    def stop_ray_force(self) -> None:
        """`ray stop --force` for this cluster: SIGKILL its Ray processes, not vLLM's."""
        for p in self.tree():
            try:
                if "VLLM" not in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass

    def close(self) -> None:
        """Whatever a test left: kill the group and any engine still alive (by pid)."""
        for pid in self.seen_engines:
            _kill(pid)
        self.stop_ray_force()  # whatever is left of this cluster (its group is not all of it)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.log.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pids) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, within_s: float = GONE_WITHIN_S) -> set[int]:
    deadline = time.monotonic() + within_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


@pytest.fixture
def app(tmp_path):
    a = App(tmp_path)
    try:
        a.wait_healthy()
        yield a
    finally:
        a.close()


def test_interrupt_then_terminate_then_ray_stop_leaves_no_engine(app):
    """The operator's sequence that leaked every engine: SIGINT to the group, 5 s later
    SIGTERM to the group and `ray stop --force`."""
    app.turn("Stop me impatiently. " * 3)
    engines = app.engines()
    assert {"decode", "prefill"} <= set(engines.values()), engines
    os.killpg(app.proc.pid, signal.SIGINT)
    time.sleep(5)
    try:
        os.killpg(app.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    app.stop_ray_force()
    assert wait_gone(engines) == set(), f"engines outlived the app: {alive(engines)}"


def test_dead_engine_is_replaced_and_a_killed_replica_takes_its_engine(app):
    """Self-healing: the decode engine core dies, Serve's health check fails and the replica
    is replaced (new replica id), and turns succeed again. Then SIGKILL of the prefill
    replica's process ends its engine, and `ray stop --force` ends the rest."""
    first = app.turn("Heal yourself. " * 3)["kvturn"]["decode_replica"]
    engines = app.engines()
    decode_engine = next(pid for pid, role in engines.items() if role == "decode")
    os.kill(decode_engine, signal.SIGKILL)

    deadline, reply, errors = time.monotonic() + 300, None, 0
    while time.monotonic() < deadline:
        try:
            reply = app.turn("Heal yourself. " * 3)
            if reply["kvturn"]["decode_replica"] != first:
                break
        except AssertionError:
            errors += 1  # turns routed to the broken replica before Serve replaced it
        time.sleep(3)
    assert reply is not None and reply["kvturn"]["decode_replica"] != first, app.tail()
    assert reply["choices"][0]["message"]["content"] is not None

    prefill_engine = next(pid for pid, role in app.engines().items() if role == "prefill")
    replica = psutil.Process(prefill_engine).parent()
    replica.kill()
    assert wait_gone([prefill_engine]) == set(), "the prefill engine outlived its replica"

    everything = set(app.engines()) | set(engines)
    app.stop_ray_force()
    assert wait_gone(everything) == set(), f"engines outlived `ray stop --force`: {alive(everything)}"
