"""The benchmark end to end (`python -m bench --profile smoke`): it deploys oneway, bidir
and single one after another on a Ray cluster of its own (a subprocess, so it never
touches the cluster the other end-to-end tests share), drives two 2-turn sessions
through each, and writes results whose numbers come from the engines themselves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODES = ("oneway", "bidir", "single")
SHARED_CLUSTER_PORT = 8123  # the Serve port of the shared test cluster (conftest.py)

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    port = _free_port()
    assert port != SHARED_CLUSTER_PORT
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--profile",
            "smoke",
            "--out",
            str(out),
            "--port",
            str(port),
            "--no-progress",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), out, proc.stdout


def test_every_mode_measured_every_turn(smoke):
    results, _, _ = smoke
    assert list(results["modes"]) == list(MODES)
    turns = results["workload"]["turns"]
    sessions = results["workload"]["sessions"]
    assert (turns, sessions) == (2, 2)
    for mode, data in results["modes"].items():
        assert [row["turn"] for row in data["turns"]] == list(range(1, turns + 1)), mode
        for row in data["turns"]:
            assert row["requests"] == sessions and row["errors"] == 0, (mode, row)
            assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["e2e_mean_s"], (mode, row)
            assert row["itl_mean_s"] > 0 and row["output_tok_s"] > 0, (mode, row)
            # The app's own breakdown of TTFT: a prefill leg only in P/D modes.
            assert 0 < row["app_first_token_mean_s"] <= row["ttft_p90_s"], (mode, row)
            assert (row["app_prefill_done_mean_s"] is None) == (mode == "single"), (mode, row)
            # ignore_eos: every answer has exactly the requested length
            assert row["completion_tokens"] == sessions * results["workload"]["answer_tokens"], (mode, row)
        # the second turn re-sends the first turn's prompt and answer
        t1, t2 = data["turns"]
        assert t2["prompt_tokens_mean"] > t1["prompt_tokens_mean"] + results["workload"]["answer_tokens"], (
            mode
        )


def test_ratios_per_turn(smoke):
    results, _, _ = smoke
    ratios = results["ratios"]
    assert set(ratios) == {"oneway/bidir", "bidir/single"}
    for key, (num, den) in {"oneway/bidir": ("oneway", "bidir"), "bidir/single": ("bidir", "single")}.items():
        rows = ratios[key]["per_turn"]
        assert [r["turn"] for r in rows] == [1, 2]
        for r in rows:
            a = results["modes"][num]["turns"][r["turn"] - 1]["ttft_p50_s"]
            b = results["modes"][den]["turns"][r["turn"] - 1]["ttft_p50_s"]
            assert r["ttft_p50"] == pytest.approx(a / b)


def test_bidir_pulls_history_and_oneway_does_not(smoke):
    results, _, _ = smoke
    bidir, oneway, single = (results["modes"][m] for m in ("bidir", "oneway", "single"))
    # Engine counters over the measured phase (prefill prefix caching is off in smoke).
    assert bidir["engines"]["prefill"]["prompt_tokens_external"] > 0
    assert bidir["prefill_tokens"]["pulled"] == bidir["engines"]["prefill"]["prompt_tokens_external"]
    assert oneway["engines"]["prefill"]["prompt_tokens_external"] == 0
    assert oneway["prefill_tokens"]["pulled"] == 0
    # What the client was told agrees: only bidir's second turns reused decode's history,
    # and then prefill did not compute it.
    b2, o2 = bidir["turns"][1], oneway["turns"][1]
    assert b2["reused_from_decode"] > 0 and b2["cached_tokens"] > 0
    assert o2["reused_from_decode"] == 0 and o2["cached_tokens"] == 0
    assert bidir["turns"][0]["reused_from_decode"] == 0
    # In P/D the decode engine reads each prompt from prefill; the single engine has no peer.
    assert oneway["engines"]["decode"]["prompt_tokens_external"] > 0
    assert "prefill" not in single["engines"]
    assert single["engines"]["decode"]["prompt_tokens_external"] == 0
    # Session affinity: the single engine's second turns hit its own prefix cache.
    assert single["turns"][1]["cached_tokens"] > 0


def test_outputs_written(smoke):
    results, out, stdout = smoke
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "| turn | prompt tokens | TTFT p50 oneway (s) | TTFT p50 bidir (s) | TTFT p50 single (s) |" in stdout
    )
    assert results["profile"] == "smoke" and results["duration_s"] > 0
    requests = results["modes"]["bidir"]["requests"]
    assert len(requests) == 4 and all(r["ok"] for r in requests)
