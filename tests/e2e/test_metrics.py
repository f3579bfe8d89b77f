"""Prometheus metrics end to end: a 2-turn conversation on the shared `pd` app, then a
scrape of the node's metrics export port (`tests/conftest.py` starts Ray with it), where
the reuse counters carry exactly what the turns reported and the engines counted.

The conversation carries 16 earlier assistant messages, so both its turns fall in the
`17+` turn-index bucket that no other test uses: their counters are this test's alone."""

from __future__ import annotations

import re
import time
from collections import defaultdict

import httpx

from tests.conftest import METRICS_PORT
from tests.e2e.helpers import SYSTEM, chat, engine_stats

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape() -> dict[str, list[tuple[dict, float]]]:
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text
    series = defaultdict(list)
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and not line.startswith("#"):
            series[m.group(1)].append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return series


def total(series, name: str, **labels) -> float:
    return sum(v for tags, v in series.get(name, []) if all(tags.get(k) == w for k, w in labels.items()))


def wait_for(check, timeout_s: float = 90.0):
    """Ray flushes metrics every few seconds: scrape until `check(series)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        series = scrape()
        try:
            check(series)
            return series
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(2)


def test_reuse_counters_on_the_metrics_port(apps):
    url = apps["url"]
    messages = [{"role": "system", "content": SYSTEM}]
    for i in range(16):
        messages += [{"role": "user", "content": f"step {i}"}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": "Now summarise the build log for me. " * 3})
    first = chat(url, messages, session="metrics-1", max_tokens=16)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Tool result: all green. " * 4},
    ]
    before = engine_stats("PrefillServer")
    second = chat(url, messages, session="metrics-1", max_tokens=16, stream=True)
    pulled = second.usage["prompt_tokens_details"]["cached_tokens"]
    assert pulled > 0 and second.kvturn["reused_from_decode"] >= pulled - apps["pd"].block_size
    replies = (first, second)
    turn = {"mode": "bidir", "turn": "17+"}

    def reuse_counted(s):
        assert total(s, "ray_kvturn_turns_total", **turn) == 2
        # Prefill's own prefix cache is off: every cached token was pulled from decode.
        assert total(s, "ray_kvturn_tokens_cached_total", **turn) == pulled
        assert total(s, "ray_kvturn_tokens_pulled_total", **turn) == second.kvturn["reused_from_decode"]
        assert total(s, "ray_kvturn_prompt_tokens_total", **turn) == sum(
            r.usage["prompt_tokens"] for r in replies
        )
        computed = sum(
            r.usage["prompt_tokens"] - r.usage["prompt_tokens_details"]["cached_tokens"] for r in replies
        )
        assert total(s, "ray_kvturn_tokens_computed_total", **turn) == computed
        assert total(s, "ray_kvturn_ttft_seconds_count", **turn) == 2
        assert total(s, "ray_kvturn_kv_misses_total", mode="bidir", reason="no_conversation") >= 1
        assert total(s, "ray_kvturn_store_op_seconds_count", op="begin_turn") >= 2
        assert total(s, "ray_kvturn_store_op_seconds_count", op="end_turn") >= 2

    series = wait_for(reuse_counted)

    # The engines' side: prefill's NIXL reads as its replica counts them, decode's blocks.
    after = engine_stats("PrefillServer")
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"]

    # Other apps on the shared cluster export their engines too: this app's prefill only.
    engine = after["engine_id"]

    def engines_counted(s):
        assert (
            total(s, "ray_kvturn_nixl_transfer_bytes_total", role="prefill", engine=engine)
            == after["kv_transfer_bytes"]
        )
        assert (
            total(s, "ray_kvturn_nixl_transfers_total", role="prefill", engine=engine)
            == after["kv_transfers"]
        )
        assert total(s, "ray_kvturn_nixl_transfer_seconds_total", role="prefill", engine=engine) > 0
        assert total(s, "ray_kvturn_engine_kv_blocks", role="decode") > 0
        assert "ray_kvturn_engine_kv_blocks_in_use" in s
        assert "ray_kvturn_store_handles" in s and "ray_kvturn_store_sessions" in s

    series = wait_for(engines_counted)
    # vLLM's own engine metrics, through its Ray stat logger.
    vllm = [name for name in series if name.startswith("ray_vllm")]
    assert any("prompt_tokens" in name for name in vllm), vllm
