"""Decode-local turns (`transfer.decode_local_tokens`), end to end with real engines: a
turn that adds few tokens is computed by the session's decode engine over its own prefix
cache, with no prefill leg and no transfer; a turn that adds more goes through prefill,
which pulls the history, including what the local turn added. Greedy tokens equal a
recomputing engine's either way; the engines' own counters say who computed what.

The blocks a decode-local request pins live by the same rules as any other decode pin
(the decode engine's own block pool says so): freed once prefill has read them, and at
the decoder TTL on an idle engine when nobody does."""

from __future__ import annotations

import time

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, chat, delta, engine_stats, kv_stats, reference_tokens

LIMIT = 48
APP = "loc"
DECODER_TTL_S = 20.0


@pytest.fixture(scope="module")
def loc(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(
        app_name=APP,
        **{
            "decode.num_replicas": 1,
            "transfer.decode_local_tokens": LIMIT,
            "transfer.decoder_kv_blocks_ttl_s": DECODER_TTL_S,
            "sessions.handle_ttl_s": 12,
        },
    )
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    yield {"url": apps["url"] + "/" + APP, "cfg": cfg}
    serve.delete(APP)


def _stats():
    return engine_stats("PrefillServer", app=APP), engine_stats("DecodeServer", app=APP)


def _blocks() -> dict:
    from ray import serve

    from app.engines.wire import ReplicaQuery

    return serve.get_deployment_handle("DecodeServer", APP).kv_blocks.remote(ReplicaQuery()).result()


def _wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_short_turns_stay_on_decode_and_long_ones_pull_the_history(apps, loc):
    block = loc["cfg"].block_size
    url = loc["url"]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look at the logs and the build. " * 3},
    ]

    # Turn 1: a prompt longer than the limit goes through prefill.
    p0, d0 = _stats()
    r1 = chat(url, messages, session="local-1", max_tokens=16)
    assert len(r1.prompt_token_ids) > LIMIT
    p1, d1 = _stats()
    assert delta(p1, p0)["prompt_tokens_total"] == len(r1.prompt_token_ids)
    # Decode read the prompt's KV: no step of its computed a prompt; a step per token.
    d = delta(d1, d0)
    assert d["engine_prompt_steps"] == 0, d
    assert len(r1.token_ids) - 1 <= d["engine_busy_steps"] <= len(r1.token_ids) + 2, d
    assert r1.token_ids == reference_tokens(apps["url"], r1.prompt_token_ids, len(r1.token_ids))
    history = len(r1.prompt_token_ids) + len(r1.token_ids) - 1

    # Turn 2 adds a few tokens: decode alone, over the blocks it kept from turn 1.
    messages += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Go on."}]
    r2 = chat(url, messages, session="local-1", max_tokens=16)
    new_tokens = len(r2.prompt_token_ids) - history
    assert r2.kvturn["spliced"] and 0 < new_tokens <= LIMIT
    p2, d2 = _stats()
    assert delta(p2, p1)["prompt_tokens_total"] == 0, "the prefill engine got no request"
    d = delta(d2, d1)
    assert d["prompt_tokens_local_hit"] >= history - block, (d, history)
    assert d["prompt_tokens_computed"] <= new_tokens + block, (d, new_tokens)
    assert d["prompt_tokens_external"] == 0 and d["kv_transfers"] == 0
    # Its steps: one a token. The step that computed its prompt began on an idle engine,
    # so it is no busy step (its time would include the wait).
    assert d["engine_prompt_steps"] == 0, d
    assert len(r2.token_ids) - 1 <= d["engine_busy_steps"] <= len(r2.token_ids) + 2, d
    assert d["engine_busy_step_seqs"] <= d["engine_busy_steps"], d  # one sequence ran
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == d["prompt_tokens_local_hit"]
    assert r2.kvturn["reused_from_decode"] == 0 and "prefill_s" not in r2.kvturn["timings"]
    assert r2.token_ids == reference_tokens(apps["url"], r2.prompt_token_ids, len(r2.token_ids))
    assert kv_stats(url)["turns"]["decode_local"] == 1

    # Turn 3 adds a long tool result: prefill pulls the history, turn 2's tokens included.
    history = len(r2.prompt_token_ids) + len(r2.token_ids) - 1
    messages += [
        {"role": "assistant", "content": r2.text},
        {"role": "user", "content": "Tool result: " + "build ok, 0 warnings; " * 12},
    ]
    r3 = chat(url, messages, session="local-1", max_tokens=16)
    assert len(r3.prompt_token_ids) - history > LIMIT
    p3, _ = _stats()
    p = delta(p3, p2)
    assert p["prompt_tokens_external"] >= history - block, (p, history)
    assert p["prompt_tokens_computed"] <= len(r3.prompt_token_ids) - history + block, p
    assert p["kv_transfers"] >= 1 and p["kv_failed_transfers"] == 0, p
    assert r3.kvturn["reused_from_decode"] >= history - block
    assert r3.token_ids == reference_tokens(apps["url"], r3.prompt_token_ids, len(r3.token_ids))
    assert kv_stats(url)["turns"]["decode_local"] == 1
    # Prefill's read of turn 2's blocks freed them on decode: only turn 3's pin is left
    # (turn 1's was released when turn 2 stayed local).
    blocks = _wait_for(lambda: (b := _blocks())["pinned_requests"] == 1 and b, 10)
    assert blocks, _blocks()


def test_pin_of_a_decode_local_request_expires_on_an_idle_engine(apps, loc):
    """A decode request that computes its prompt itself, sent straight to the decode
    replica (no ingress, no store to release it): its blocks are pinned for the next
    turn's pull, and the idle engine frees them at its TTL by itself."""
    from ray import serve

    from app.engines.wire import EngineRequest, Sampling
    from connector.handle import KVHandle, local_decode_params

    decode = serve.get_deployment_handle("DecodeServer", APP).options(stream=True)
    before = _blocks()
    request = EngineRequest(
        request_id=f"idle-pin-{time.monotonic_ns()}",
        prompt_token_ids=tuple(range(100, 100 + 3 * loc["cfg"].block_size)),
        sampling=Sampling(max_tokens=4, temperature=0.0),
        kv_params=local_decode_params(),
    )
    final = [chunk for chunk, _ in decode.generate.remote(request)][-1]
    handle = KVHandle.from_wire(final.kv_params)  # the blocks are pinned for a pull
    pinned = _blocks()
    assert (
        pinned["pinned_requests"] >= before["pinned_requests"] + 1 and pinned["pinned"] >= handle.num_blocks
    )
    ended = time.monotonic()
    # Nothing else runs on this engine now: only its own TTL can free the blocks.
    idle = _wait_for(lambda: (b := _blocks())["pinned"] == 0 and b, DECODER_TTL_S + 15)
    assert idle and idle["pinned_requests"] == 0, _blocks()
    assert time.monotonic() - ended >= DECODER_TTL_S - 2, "freed before its TTL: not by the TTL"
