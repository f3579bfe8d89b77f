"""Decode-local turns (`transfer.decode_local_tokens`), end to end with real engines: a
turn that adds few tokens is computed by the session's decode engine over its own prefix
cache, with no prefill leg and no transfer; a turn that adds more goes through prefill,
which pulls the history, including what the local turn added. Greedy tokens equal a
recomputing engine's either way; the engines' own counters say who computed what."""

from __future__ import annotations

import pytest

from tests.conftest import pd_config
from tests.e2e.helpers import SYSTEM, chat, delta, engine_stats, kv_stats, reference_tokens

LIMIT = 48
APP = "loc"


@pytest.fixture(scope="module")
def loc(apps):
    from ray import serve

    from app.builder import build

    cfg = pd_config(app_name=APP, **{"decode.num_replicas": 1, "transfer.decode_local_tokens": LIMIT})
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    yield {"url": apps["url"] + "/" + APP, "cfg": cfg}
    serve.delete(APP)


def _stats():
    return engine_stats("PrefillServer", app=APP), engine_stats("DecodeServer", app=APP)


def test_short_turns_stay_on_decode_and_long_ones_pull_the_history(apps, loc):
    block = loc["cfg"].block_size
    url = loc["url"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Look at the logs and the build. " * 3}]

    # Turn 1: a prompt longer than the limit goes through prefill.
    p0, d0 = _stats()
    r1 = chat(url, messages, session="local-1", max_tokens=16)
    assert len(r1.prompt_token_ids) > LIMIT
    p1, d1 = _stats()
    assert delta(p1, p0)["prompt_tokens_total"] == len(r1.prompt_token_ids)
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
    assert r2.usage["prompt_tokens_details"]["cached_tokens"] == d["prompt_tokens_local_hit"]
    assert r2.kvturn["reused_from_decode"] == 0 and "prefill_s" not in r2.kvturn["timings"]
    assert r2.token_ids == reference_tokens(apps["url"], r2.prompt_token_ids, len(r2.token_ids))
    assert kv_stats(url)["turns"]["decode_local"] == 1

    # Turn 3 adds a long tool result: prefill pulls the history, turn 2's tokens included.
    history = len(r2.prompt_token_ids) + len(r2.token_ids) - 1
    messages += [{"role": "assistant", "content": r2.text}, {"role": "user", "content": "Tool result: " + "build ok, 0 warnings; " * 12}]
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
