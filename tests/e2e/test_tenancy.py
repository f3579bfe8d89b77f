"""Tenants on one fleet, end to end with real engines: prefix caches isolated per API key
(cache salts), fair shares of the decode engine's pinned budget, quotas.

An app of its own (`ten`: 1 prefill with prefix caching on, 1 decode with a small KV
cache, decode-local turns on), three keys. Isolation is read from `cached_tokens` (what a
tenant would use to probe) and from the engines' own counters; shares from the store's
per-tenant state and each session's next claim."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import config_with, pd_config
from tests.e2e.helpers import MODEL, SYSTEM, engine_stats, reference_tokens

pytestmark = pytest.mark.e2e

APP = "ten"
KEY_A, KEY_B, KEY_C = "tenant-a-key", "tenant-b-key", "tenant-c-key"
PROBES = ("probe-1-key", "probe-2-key", "probe-3-key")
"""Other tenants, each sending tenant A's conversation once (a tenant re-sending its own
prompt rightly hits its own cache)."""
DECODE_BLOCKS = 160
TOKENS_PER_MINUTE_C = 200


@pytest.fixture(scope="module")
def ten(apps):
    from ray import serve

    from app.builder import build

    tree = pd_config(app_name=APP).model_dump(mode="python")
    cfg = config_with(
        tree,
        {
            "prefill.enable_prefix_caching": True,
            "decode.num_replicas": 1,
            "decode.engine_kwargs": {"num_gpu_blocks_override": DECODE_BLOCKS + 1},
            "transfer.decode_local_tokens": 512,
            "transfer.decoder_kv_blocks_ttl_s": 120,
            "sessions.handle_ttl_s": 100,
            "sessions.pinned_fraction": 0.5,
            "access.api_keys": [KEY_A, KEY_B, KEY_C, *PROBES],
            "access.tenants": {KEY_C: {"prompt_tokens_per_minute": TOKENS_PER_MINUTE_C}},
        },
    )
    serve.run(build(cfg), name=APP, route_prefix="/" + APP)
    yield {"url": apps["url"] + "/" + APP, "ref": apps["url"], "cfg": cfg}
    serve.delete(APP)


def post(
    url: str, key: str, messages: list, session: str | None = None, max_tokens: int = 16
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if session:
        headers["x-session-id"] = session
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def own_figures(url: str, key: str) -> dict:
    """The store's figures of the caller's tenant (the only one `/v1/kv/stats` shows it)."""
    stats = httpx.get(url + "/v1/kv/stats", headers={"authorization": f"Bearer {key}"}, timeout=30).json()
    out: dict = {}
    for shard in stats["store"]["shards"]:
        assert len(shard["tenants"]) <= 1, shard["tenants"]  # never another tenant's
        for figures in shard["tenants"].values():
            for k, v in figures.items():
                out[k] = out.get(k, 0) + v
    return out


def test_another_tenant_never_hits_a_tenants_cached_prompt(ten):
    url = ten["url"]
    secret = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Confidential: the merger closes on Friday. " * 8},
    ]
    a1 = ok(post(url, KEY_A, secret, session="deal"))
    follow = secret + [
        {"role": "assistant", "content": a1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Summarise it."},
    ]
    a2 = ok(post(url, KEY_A, follow, session="deal"))
    assert cached(a2) >= len(a1["prompt_token_ids"]) - ten["cfg"].block_size  # A reuses its own history
    # Other tenants send A's exact conversation: under A's session id, a new one, none.
    probes = []
    for key, session in zip(PROBES, ("deal", "probe-new", None), strict=True):
        b = ok(post(url, key, follow, session=session))
        assert cached(b) == 0, (session, b["usage"])
        assert b["kvturn"]["reused_from_decode"] == 0
        assert b["kvturn"]["miss_reason"] in (None, "no_conversation")
        probes.append((key, b["kvturn"]["session_id"]))
    # Within tenant A the cache works: the same prompt under a new session id hits it.
    again = ok(post(url, KEY_A, secret, session="deal-copy"))
    assert cached(again) >= len(again["prompt_token_ids"]) - ten["cfg"].block_size
    # A's conversation is intact: its next turn reuses the history, answer as recomputed.
    follow2 = follow + [
        {"role": "assistant", "content": a2["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Go on. " * 30},
    ]
    a3 = ok(post(url, KEY_A, follow2, session="deal"))
    assert a3["kvturn"]["miss_reason"] is None
    assert cached(a3) >= len(a2["prompt_token_ids"]) - ten["cfg"].block_size
    ids = a3["choices"][0]["token_ids"]
    assert ids == reference_tokens(ten["ref"], a3["prompt_token_ids"], len(ids))
    # B deleting "deal" deletes nothing of A's.
    r = httpx.delete(url + "/v1/sessions/deal", headers={"authorization": f"Bearer {KEY_B}"}, timeout=30)
    assert r.status_code == 404  # B has no "deal" (the probe with that id was another tenant)
    assert ok(post(url, KEY_A, follow2, session="deal"))["kvturn"]["miss_reason"] is None
    # Leave the engine's pinned budget to the next test: every tenant ends its sessions.
    for key, session in [(KEY_A, "deal"), (KEY_A, "deal-copy"), *probes]:
        r = httpx.delete(
            f"{url}/v1/sessions/{session}", headers={"authorization": f"Bearer {key}"}, timeout=30
        )
        assert r.status_code == 200, (key, session, r.text)


def test_a_burst_over_its_share_evicts_only_its_own_conversations(ten):
    url = ten["url"]
    decode = engine_stats("DecodeServer", app=APP)
    assert decode["prompt_tokens_total"] > 0
    budget_blocks = int(0.5 * DECODE_BLOCKS)
    keep = {}
    for i in range(2):  # tenant A: two small conversations, well within half the budget
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Tenant A task {i}: check the build."},
        ]
        keep[f"a-{i}"] = (msgs, ok(post(url, KEY_A, msgs, session=f"a-{i}")))
    before_a, before_b = own_figures(url, KEY_A), own_figures(url, KEY_B)
    # Tenant B: a burst of conversations that together need more than the whole budget.
    words = "deploy rollback canary metrics latency error budget region shard replica".split()
    need = 0
    for i in range(40):
        text = f"Tenant B burst {i}: " + " ".join(words[(i + j) % len(words)] for j in range(120))
        b = ok(post(url, KEY_B, [{"role": "user", "content": text}], session=f"b-{i}"))
        need += (len(b["prompt_token_ids"]) + 16) // ten["cfg"].block_size + 1
        if need > 2 * budget_blocks:
            break
    after_a, after_b = own_figures(url, KEY_A), own_figures(url, KEY_B)
    assert after_b.get("evicted_for_blocks", 0) - before_b.get("evicted_for_blocks", 0) > 0, (
        before_b,
        after_b,
    )
    assert after_a.get("evicted_for_blocks", 0) == before_a.get("evicted_for_blocks", 0), (before_a, after_a)
    assert after_b["pinned_blocks"] <= budget_blocks
    # A's conversations kept their handles: their next turns claim them.
    for session, (msgs, first) in keep.items():
        follow = msgs + [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And?"},
        ]
        nxt = ok(post(url, KEY_A, follow, session=session))
        assert nxt["kvturn"]["miss_reason"] is None, nxt["kvturn"]


def test_a_tenant_over_its_token_rate_is_refused_with_retry_after(ten):
    url = ten["url"]
    long = [{"role": "user", "content": "Rate limited tenant: " + "word " * 150}]
    first = post(url, KEY_C, long, session="c-1")
    assert first.status_code == 200, first.text  # alone in its window, it runs
    refused = post(url, KEY_C, long, session="c-2")
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # Nothing of the refused turn reached the store: no session c-2 to delete.
    r = httpx.delete(url + "/v1/sessions/c-2", headers={"authorization": f"Bearer {KEY_C}"}, timeout=30)
    assert r.status_code == 404
    # Other tenants are not limited by it.
    assert post(url, KEY_A, long, session="a-rate").status_code == 200


def test_stored_responses_and_messages_keys_belong_to_their_tenant(ten):
    url = ten["url"]
    auth = lambda key: {"authorization": f"Bearer {key}"}  # noqa: E731
    body = {
        "model": MODEL,
        "instructions": SYSTEM,
        "input": "Our launch date is secret.",
        "max_output_tokens": 8,
    }
    first = ok(
        httpx.post(url + "/v1/responses", json={**body, "temperature": 0}, headers=auth(KEY_A), timeout=300)
    )
    rid = first["id"]
    # Another tenant can neither read, continue nor delete it.
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=auth(KEY_B), timeout=30).status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{rid}", headers=auth(KEY_B), timeout=30).status_code == 404
    cont = {"model": MODEL, "input": "When is it?", "previous_response_id": rid, "max_output_tokens": 8}
    theirs = httpx.post(url + "/v1/responses", json=cont, headers=auth(KEY_B), timeout=300)
    assert theirs.status_code == 400 and theirs.json()["error"]["code"] == "previous_response_not_found"
    shards = httpx.get(url + "/v1/kv/stats", headers=auth(KEY_B), timeout=30).json()["store"]["shards"]
    assert all(not s["responses"]["response_tenants"] for s in shards), shards
    # Its own tenant continues it with the history reused.
    mine = ok(
        httpx.post(
            url + "/v1/responses", json={**cont, "instructions": SYSTEM}, headers=auth(KEY_A), timeout=300
        )
    )
    history = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert mine["usage"]["input_tokens_details"]["cached_tokens"] >= 0.9 * history - ten["cfg"].block_size
    assert (
        httpx.delete(f"{url}/v1/responses/{mine['id']}", headers=auth(KEY_A), timeout=30).status_code == 200
    )
    # The Messages API takes the key as x-api-key, and refuses in Anthropic's shape without one.
    message = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert (
        ok(httpx.post(url + "/v1/messages", json=message, headers={"x-api-key": KEY_B}, timeout=300))["type"]
        == "message"
    )
    refused = httpx.post(url + "/v1/messages", json=message, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
