"""API keys end to end: an ingress with two keys in front of the shared `pd` app's
engines (an ingress-only app, no engine of its own), real engines and NIXL behind it."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from tests.conftest import pd_config
from tests.e2e.helpers import MODEL, SYSTEM, engine_stats

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"


@pytest.fixture(scope="module")
def keyed(apps):
    from app.api.ingress import Ingress

    cfg = pd_config(
        app_name="pd-keys", **{"access.api_keys": [KEY_A, KEY_B], "access.expose_kv_stats": False}
    )
    prefill = serve.get_deployment_handle("PrefillServer", "pd")
    decode = serve.get_deployment_handle("DecodeServer", "pd")
    # pd's own store too (sessions of both apps in one store: the namespaces keep them apart).
    store = serve.get_deployment_handle("SessionStore", "pd")
    app = Ingress.options(ray_actor_options={"num_cpus": 0}).bind(cfg, prefill, decode, store)
    serve.run(app, name="pd-keys", route_prefix="/keys")
    yield apps["url"] + "/keys"
    serve.delete("pd-keys")


def post(url, key, messages, session=None, **extra):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if session:
        headers["x-session-id"] = session
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def test_keys_are_required_except_for_health(keyed):
    assert httpx.get(keyed + "/health", timeout=30).status_code == 200
    msgs = [{"role": "user", "content": "hi"}]
    for key in (None, "wrong"):
        for r in (
            httpx.get(
                keyed + "/v1/models", headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30
            ),
            post(keyed, key, msgs),
        ):
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert (
        httpx.get(keyed + "/v1/models", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30).status_code
        == 200
    )
    # Switched off by config.
    r = httpx.get(keyed + "/v1/kv/stats", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    # Trusted handle callers, or a tenant with api_key=.
    h = serve.get_app_handle("pd-keys")
    body = {"model": MODEL, "messages": msgs, "max_tokens": 4}
    assert h.chat.remote(body).result()["choices"]
    with pytest.raises(Exception, match="API key"):
        h.chat.remote(body, api_key="wrong").result()


def test_same_session_header_does_not_cross_tenants(keyed):
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Check the deploy logs, tenant A. " * 3},
    ]
    r1 = post(keyed, KEY_A, msgs, session="shared")
    assert r1.status_code == 200 and r1.json()["kvturn"]["session_id"] == "shared"
    assert r1.json()["kvturn"]["miss_reason"] == "no_conversation"  # the store answered
    follow = msgs + [
        {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Tool: ok. " * 6},
    ]
    before = engine_stats("PrefillServer")
    rb = post(keyed, KEY_B, follow, session="shared").json()
    assert rb["kvturn"]["session_id"] == "shared" and rb["kvturn"]["miss_reason"] == "no_conversation"
    assert rb["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert engine_stats("PrefillServer")["prompt_tokens_external"] == before["prompt_tokens_external"]
    # Tenant A's conversation was neither claimed nor replaced: its next turn pulls it.
    ra = post(keyed, KEY_A, follow, session="shared").json()
    assert ra["kvturn"]["miss_reason"] is None
    cached = ra["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert (
        engine_stats("PrefillServer")["prompt_tokens_external"] - before["prompt_tokens_external"] == cached
    )


def test_sessionless_matching_never_crosses_tenants(keyed):
    msgs = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "No header here, tenant A speaking. " * 3},
    ]
    r1 = post(keyed, KEY_A, msgs).json()
    follow = msgs + [
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Tool: done. " * 6},
    ]
    ra = post(keyed, KEY_A, follow).json()
    assert ra["kvturn"]["session_id"] == r1["kvturn"]["session_id"]
    assert ra["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # The same prompt from tenant B: a new session of its own, nothing reused.
    rb = post(keyed, KEY_B, follow).json()
    assert rb["kvturn"]["session_id"] != r1["kvturn"]["session_id"]
    assert rb["kvturn"]["miss_reason"] == "no_conversation"
    assert rb["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
