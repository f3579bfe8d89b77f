"""API keys (`app.api.auth`) and tenant namespaces of sessions through the real turn
orchestration (`app.turn.turns` with the fake engines and the real handle store)."""

from __future__ import annotations

import pytest

from app.api.auth import TRUSTED_NAMESPACE, ApiKeys, namespace_of, scoped
from app.api.protocol import APIError
from app.config import AppConfig
from tests.test_turns import P1, USER2, Rig, enc, model_dir  # noqa: F401  (fixture)


def test_no_keys_checks_nothing():
    keys = ApiKeys(())
    assert not keys.enabled
    assert keys.namespace(None) == "" and keys.namespace("Bearer whatever") == ""
    assert keys.handle_namespace(None) == "" and keys.handle_namespace("x") == ""


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer  ", "Basic k1", "k1", "Bearer k3", "Bearer k1x"]
)
def test_missing_or_wrong_key_is_401(header):
    with pytest.raises(APIError) as err:
        ApiKeys(("k1", "k2")).namespace(header)
    assert err.value.status == 401
    body = err.value.body()["error"]
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error" and body["message"]


def test_each_key_is_its_own_namespace():
    keys = ApiKeys(("k1", "k2"))
    a, b = keys.namespace("Bearer k1"), keys.namespace("bearer k2")
    assert a == namespace_of("k1") and b == namespace_of("k2")
    assert a != b and not a.startswith(b) and not b.startswith(a)
    assert "k1" not in a  # the key itself never ends up in session ids
    assert scoped(a, "chat-1") == a + "chat-1" and scoped(a, None) is None


def test_handle_callers_are_trusted_or_a_tenant():
    keys = ApiKeys(("k1",))
    assert keys.handle_namespace(None) == TRUSTED_NAMESPACE
    assert keys.handle_namespace("k1") == namespace_of("k1")
    with pytest.raises(APIError) as err:
        keys.handle_namespace("nope")
    assert err.value.status == 401


def test_config_keys(tmp_path):
    cfg = AppConfig.from_args({"model": str(tmp_path), "access.api_keys": "k1, k2"})
    assert cfg.access.api_keys == ("k1", "k2") and cfg.access.expose_kv_stats
    assert AppConfig.from_args({"model": str(tmp_path)}).access.api_keys == ()
    with pytest.raises(ValueError):
        AppConfig.model_validate({"model": str(tmp_path), "access": {"api_keys": [" k"]}})


async def test_same_session_header_of_two_tenants_never_shares_a_conversation(model_dir):  # noqa: F811
    rig = Rig(model_dir)
    a, b = namespace_of("k1"), namespace_of("k2")
    text1, _, r1 = await rig.turn(text=P1, session=scoped(a, "chat"), namespace=a)
    assert r1.session_id == "chat"  # the client sees its own id
    # Tenant b sends the same header and a prompt extending a's conversation: no claim, no reuse.
    _, _, rb = await rig.turn(text=P1 + text1 + USER2, session=scoped(b, "chat"), namespace=b)
    assert rb.session_id == "chat" and rb.miss_reason == "no_conversation" and rb.cached_tokens == 0
    assert not rb.spliced
    # a's conversation is intact: its next turn reuses the history.
    _, _, r2 = await rig.turn(text=P1 + text1 + USER2, session=scoped(a, "chat"), namespace=a)
    assert r2.miss_reason is None and r2.cached_tokens == len(enc(P1)) + len(text1) - 1
    assert set(rig.store.inner.stats()["handles"]) <= {"stored", "pulled", "unused", "superseded"}


async def test_sessionless_matching_stays_inside_the_tenant(model_dir):  # noqa: F811
    rig = Rig(model_dir)
    a, b = namespace_of("k1"), namespace_of("k2")
    text1, _, r1 = await rig.turn(text=P1, session=None, namespace=a)
    assert r1.session_id.startswith("s-") and not r1.session_id.startswith(a)
    follow_up = P1 + text1 + USER2
    _, _, ra = await rig.turn(text=follow_up, session=None, namespace=a)
    assert ra.session_id == r1.session_id and ra.cached_tokens > 0
    # Another tenant, and a trusted handle caller, sending the very same prompt: new sessions.
    _, _, rb = await rig.turn(text=follow_up, session=None, namespace=b)
    assert rb.session_id != r1.session_id and rb.cached_tokens == 0 and rb.miss_reason == "no_conversation"
    _, _, rt = await rig.turn(text=follow_up, session=None, namespace=TRUSTED_NAMESPACE)
    assert rt.session_id not in (r1.session_id, rb.session_id) and rt.cached_tokens == 0
    assert rig.turns.counts["sessionless_matched"] == 1
