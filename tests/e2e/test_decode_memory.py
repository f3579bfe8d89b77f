"""Decode memory under pressure, on real engines: a pinned-KV budget the decode engine
really keeps, early release of the blocks the store lets go, safe pull deadlines, and an
explicit end of a session.

A small app of its own (`mem`: 1 prefill + 1 decode engine whose KV cache holds a few
hundred blocks) beside a single-engine reference (`memref`), deleted at the end of the
module. Every figure about blocks is the decode engine's own count, read from its
scheduler's block pool (`DecodeServer.kv_blocks`).
"""

from __future__ import annotations

import glob
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import MODEL, PD_PORT, config_with
from tests.e2e.helpers import MODEL as MODEL_NAME
from tests.e2e.helpers import SYSTEM, chat

pytestmark = pytest.mark.e2e

BLOCK = 32
KV_BYTES_PER_BLOCK = (
    2 * 4 * 2 * 64 * BLOCK * 4
)  # K and V, 4 layers, 2 KV heads, head_dim 64, 4 bytes (CPU engine: float32)
DECODE_BLOCKS = 256
DECODER_TTL_S = 30.0
HANDLE_TTL_S = 25.0
PIN_MARGIN_S = 20.0  # a pull must be expected to end 20 s before the pin does: 10 s windows
PINNED_FRACTION = 0.5
ANSWER_TOKENS = 16
WORDS = (
    "tool result weather city temperature forecast wind rain sunny cloudy humidity pressure "
    "north south east west"
).split()


def mem_config(**overrides):
    tree = {
        "mode": "bidir",
        "model": str(MODEL),
        "enforce_eager": True,
        "max_model_len": 2048,
        "default_max_tokens": ANSWER_TOKENS,
        "prefill": {"num_cpus": 0.5, "enable_prefix_caching": False, "kv_cache_memory_bytes": 128 << 20},
        # The shared cluster's VLLM_CPU_KVCACHE_SPACE (1 GiB) wins over kv_cache_memory_bytes
        # on CPU: the block count is capped with vLLM's own override instead.
        "decode": {
            "num_cpus": 0.5,
            "kv_cache_memory_bytes": DECODE_BLOCKS * KV_BYTES_PER_BLOCK,
            "engine_kwargs": {"num_gpu_blocks_override": DECODE_BLOCKS + 1},
        },
        "transfer": {
            "recompute_threshold_tokens": 32,
            "decode_local_tokens": 0,  # every turn pins and pulls: the pressure under test
            "decode_local_busy_tokens": 0,
            "kv_buffer_device": "cpu",
            "decoder_kv_blocks_ttl_s": DECODER_TTL_S,
            "pull_timeout_s": 15,
            "pin_margin_s": PIN_MARGIN_S,
        },
        "sessions": {
            "handle_ttl_s": HANDLE_TTL_S,
            "pinned_fraction": PINNED_FRACTION,
            "release_interval_s": 0.5,
        },
        "app_name": "mem",
    }
    return config_with(tree, overrides)


@pytest.fixture(scope="module")
def mem(ray_cluster):
    from ray import serve
    from ray.serve.api import RunTarget

    from app.builder import build

    serve.start(http_options={"host": "127.0.0.1", "port": PD_PORT})
    cfg = mem_config()
    ref = mem_config(mode="single", app_name="memref", **{"decode.kv_cache_memory_bytes": 128 << 20})
    serve.run_many(
        [
            RunTarget(target=build(cfg), name="mem", route_prefix="/mem"),
            RunTarget(target=build(ref), name="memref", route_prefix="/memref"),
        ],
        wait_for_applications_running=True,
    )
    yield {"url": f"http://127.0.0.1:{PD_PORT}/mem", "ref": f"http://127.0.0.1:{PD_PORT}/memref", "cfg": cfg}
    serve.delete("mem")
    serve.delete("memref")


def decode_blocks() -> dict:
    from ray import serve

    from app.engines.wire import ReplicaQuery

    return serve.get_deployment_handle("DecodeServer", "mem").kv_blocks.remote(ReplicaQuery()).result()


def decode_stats() -> dict:
    from ray import serve

    from app.engines.wire import ReplicaQuery

    return serve.get_deployment_handle("DecodeServer", "mem").stats.remote(ReplicaQuery()).result()


def ingress_counts(url: str) -> dict:
    return httpx.get(url + "/v1/kv/stats", timeout=30).json()["turns"]


def reference(ref_url: str, prompt_ids: list[int], n: int) -> list[int]:
    r = httpx.post(
        ref_url + "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt_ids,
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def tool_result(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def wait_for(predicate, timeout_s: float, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll_s)


def budget(total: int) -> int:
    return int(PINNED_FRACTION * total)


class PinnedSampler:
    """Samples the decode engine's pinned blocks in the background."""

    def __init__(self, period_s: float = 0.2):
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self, period_s):
        while not self._stop.is_set():
            self.samples.append(decode_blocks())
            self._stop.wait(period_s)


def test_pressure_keeps_the_budget_and_frees_evicted_blocks_early(mem):
    url, ref = mem["url"], mem["ref"]
    blocks0 = decode_blocks()
    total = blocks0["total"]
    assert 150 <= total <= 400, blocks0  # sized for ~256 blocks of the tiny model's KV
    cap = budget(total)
    sessions, rounds, concurrency = 12, 3, 4
    rng = random.Random(11)
    histories = {f"mem-p{i}": [{"role": "system", "content": SYSTEM}] for i in range(sessions)}
    replies: list = []
    started = time.monotonic()

    def one_turn(session: str):
        messages = histories[session] + [{"role": "user", "content": tool_result(rng, 40)}]
        t0 = time.monotonic()
        reply = chat(url, messages, session=session, max_tokens=ANSWER_TOKENS)
        elapsed = time.monotonic() - t0
        histories[session] = messages + [{"role": "assistant", "content": reply.text}]
        return reply, elapsed

    settled_pinned = []
    with PinnedSampler() as sampler, ThreadPoolExecutor(concurrency) as pool:
        for _ in range(rounds):
            replies += list(pool.map(one_turn, list(histories)))
            # Once the round's store updates and releases are through, only what the store
            # keeps is pinned: within the budget, long before any pin's TTL.
            settled = wait_for(lambda: (b := decode_blocks())["pinned"] <= cap and b, timeout_s=5.0)
            assert settled, f"pinned blocks still over the budget of {cap}: {decode_blocks()}"
            settled_pinned.append(settled["pinned"])
    ran_s = time.monotonic() - started

    # Every request answered in bounded time, with the reference engine's greedy tokens.
    assert len(replies) == sessions * rounds
    assert max(elapsed for _, elapsed in replies) < 60
    for reply, _ in replies:
        assert reply.token_ids == reference(ref, reply.prompt_token_ids, ANSWER_TOKENS)

    # More was asked than fits: the store evicted, and the engine got those blocks back.
    counts = ingress_counts(url)
    assert counts.get("released_requests", 0) > 0 and counts.get("released_blocks", 0) > 0, counts
    peak = max(s["pinned"] for s in sampler.samples)
    largest = max(reply.usage["prompt_tokens"] + ANSWER_TOKENS for reply, _ in replies) // BLOCK + 1
    # Between an answer's end and the store's eviction the engine briefly holds both: at
    # most one conversation per request in flight over the budget.
    assert peak <= cap + concurrency * largest, (peak, cap)
    # The engine released them itself (its own expiry counter), all within the run, which
    # is shorter than the pin TTL: no pin could have expired on its own.
    assert ran_s < DECODER_TTL_S
    assert decode_stats()["kv_expired_pins"] >= counts["released_requests"] > 0
    # Reuse survived the pressure for the conversations the store kept.
    assert sum(1 for reply, _ in replies if reply.kvturn["reused_from_decode"] > 0) > 0
    assert decode_stats()["kv_reads_after_release"] == 0


def test_pull_never_started_past_the_pin_deadline(mem):
    url, ref = mem["url"], mem["ref"]
    rng = random.Random(5)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tool_result(rng, 40)}]
    r1 = chat(url, messages, session="mem-deadline", max_tokens=ANSWER_TOKENS)
    # The handle is still valid (25 s) but the pin (30 s) ends within the 20 s margin.
    time.sleep(DECODER_TTL_S - PIN_MARGIN_S + 1)
    messages += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": tool_result(rng, 40)}]
    r2 = chat(url, messages, session="mem-deadline", max_tokens=ANSWER_TOKENS)
    assert r2.kvturn["miss_reason"] == "pin_deadline" and r2.kvturn["reused_from_decode"] == 0
    assert r2.token_ids == reference(ref, r2.prompt_token_ids, ANSWER_TOKENS)
    # Right after a turn the pin has time to spare: the next turn pulls.
    messages += [{"role": "assistant", "content": r2.text}, {"role": "user", "content": tool_result(rng, 40)}]
    r3 = chat(url, messages, session="mem-deadline", max_tokens=ANSWER_TOKENS)
    assert r3.kvturn["reused_from_decode"] > 0
    assert r3.token_ids == reference(ref, r3.prompt_token_ids, ANSWER_TOKENS)
    assert ingress_counts(url).get("miss_pin_deadline", 0) >= 1
    # No read ever touched blocks the decode engine had let go: its own count, and its log.
    assert decode_stats()["kv_reads_after_release"] == 0
    assert not engine_log_lines("Potentially invalid KV blocks")


def engine_log_lines(needle: str) -> list[str]:
    """Lines of this Ray session's worker logs (engine output included) holding `needle`."""
    import ray

    try:
        logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    except AttributeError:
        logs = "/tmp/ray/session_latest/logs"
    hits = []
    for path in glob.glob(os.path.join(logs, "worker-*")):
        with open(path, errors="replace") as f:
            hits += [line for line in f if needle in line]
    return hits


def test_session_delete_frees_its_blocks_at_once(mem):
    url = mem["url"]
    rng = random.Random(7)
    # Let earlier tests' pins settle (releases in flight) before taking the baseline.
    time.sleep(1.0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tool_result(rng, 120)}]
    reply = chat(url, messages, session="mem-delete", max_tokens=ANSWER_TOKENS)
    # Full blocks the turn pins, less one: the system prompt's leading block is shared with
    # other sessions' pinned turns (decode's prefix cache) and stays pinned for them.
    held = (reply.usage["prompt_tokens"] + ANSWER_TOKENS - 1) // BLOCK - 1
    assert held >= 8
    before = decode_blocks()
    r = httpx.delete(url + "/v1/sessions/mem-delete", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "mem-delete", "object": "session", "deleted": True}
    deleted_at = time.monotonic()
    after = wait_for(lambda: (b := decode_blocks())["free"] >= before["free"] + held and b, timeout_s=5.0)
    assert after, f"blocks not freed: before {before}, now {decode_blocks()}, expected +{held}"
    assert time.monotonic() - deleted_at < 5.0  # the pin TTL is 30 s
    assert after["pinned"] <= before["pinned"] - held
    # The session is gone: deleting it again is a 404, and its next turn starts afresh.
    again = httpx.delete(url + "/v1/sessions/mem-delete", timeout=30)
    assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "and now?"}]
    nxt = chat(url, messages, session="mem-delete", max_tokens=ANSWER_TOKENS)
    assert nxt.kvturn["miss_reason"] == "no_conversation" and nxt.kvturn["reused_from_decode"] == 0
