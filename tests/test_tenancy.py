"""Tenants (no engines): cache salts per key (`app.api.auth`), fair shares of pinned KV and
per-tenant session limits in the real store (`connector.shares`, `connector.store`), and
quotas at the ingress (`app.api.quotas`) on a fake clock."""

from __future__ import annotations

import itertools

import pytest

from app.api.auth import TRUSTED_NAMESPACE, ApiKeys, namespace_of, salt_of
from app.api.protocol import APIError
from app.api.quotas import Quotas
from app.config import AppConfig, TenantPolicy
from connector.handle import KVHandle, Location
from connector.settings import StoreSettings
from connector.shares import TenantShares, tenant_of
from connector.store import Conversation, HandleStore, TurnOutcome

A, B, C = namespace_of("key-a"), namespace_of("key-b"), namespace_of("key-c")
_ids = itertools.count(1)


# -- cache salts -------------------------------------------------------------------------


def test_each_key_has_its_own_salt_derived_from_it_but_not_it():
    keys = ApiKeys(("key-a", "key-b"))
    a, b = keys.tenant("Bearer key-a"), keys.tenant("Bearer key-b")
    trusted = keys.handle_tenant(None)
    salts = {a.cache_salt, b.cache_salt, trusted.cache_salt}
    assert len(salts) == 3 and None not in salts
    assert a.cache_salt == salt_of("key-a") == ApiKeys(("key-a",)).tenant("Bearer key-a").cache_salt  # stable
    assert "key-a" not in a.cache_salt and a.namespace.rstrip(":")[1:] not in a.cache_salt
    assert keys.handle_tenant("key-b") == b


def test_a_clients_salt_is_combined_with_its_tenants_never_used_as_is():
    keys = ApiKeys(("key-a", "key-b"))
    a, b = keys.tenant("Bearer key-a"), keys.tenant("Bearer key-b")
    assert a.salt_for(None) == a.cache_salt
    assert a.salt_for("x") not in ("x", a.cache_salt)
    assert a.salt_for("x") != b.salt_for("x")  # the same client salt stays per tenant
    # B cannot reach A's salt by sending it as its own.
    assert b.salt_for(a.cache_salt) != a.cache_salt


def test_sharing_the_prefix_cache_turns_salts_off_and_no_keys_means_one_tenant():
    shared = ApiKeys(("key-a",), share_prefix_cache=True)
    assert shared.tenant("Bearer key-a").cache_salt is None and shared.handle_tenant(None).cache_salt is None
    open_ = ApiKeys(())
    assert open_.tenant(None).namespace == "" and open_.tenant(None).cache_salt is None
    assert open_.tenant(None).label == "default"


def test_tenants_policies_by_key_and_the_default():
    policy = TenantPolicy(weight=3, max_concurrent_turns=2)
    keys = ApiKeys(("key-a", "key-b"), {"key-a": policy}, TenantPolicy(max_sessions=5))
    assert keys.tenant("Bearer key-a").policy == policy
    assert keys.tenant("Bearer key-b").policy.max_sessions == 5
    assert keys.handle_tenant(None).policy.max_sessions == 5


def test_config_refuses_policies_for_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="not in access.api_keys"):
        AppConfig.model_validate(
            {"model": str(tmp_path), "access": {"api_keys": ["k1"], "tenants": {"k2": {"weight": 2}}}}
        )


def test_store_tells_tenants_apart_by_the_namespaces_auth_writes():
    assert tenant_of(A + "s1") == A and tenant_of(TRUSTED_NAMESPACE + "s") == TRUSTED_NAMESPACE
    assert tenant_of("plain-session") == "" and tenant_of("k12:x") == ""


# -- shares of pinned KV, in the real store -------------------------------------------------


def handle(blocks: int, engine="d-0") -> KVHandle:
    return KVHandle(
        Location.DECODE, engine, f"req-{next(_ids)}", (tuple(range(blocks)),), "127.0.0.1", 5600, blocks * 4
    )


def store(**kw) -> HandleStore:
    settings = StoreSettings(
        handle_ttl_s=100,
        decoder_ttl_s=150,
        max_sessions=1000,
        max_blocks_per_engine=10_000,
        index_block_size=4,
    )
    return settings.handle_store(**kw)


def put(s: HandleStore, session: str, blocks: int) -> None:
    claim = s.begin_turn(session)
    s.end_turn(
        claim.lease_id,
        TurnOutcome.UNUSED,
        Conversation(session, (1, 2, 3, 4, 5), 3, handle=handle(blocks), decode_replica="r0"),
    )


def has_handle(s: HandleStore, session: str) -> bool:
    claim = s.begin_turn(session)
    s.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    return claim.handle is not None


def test_a_burst_over_its_share_evicts_only_its_own_conversations():
    s = store()
    s.set_engine_capacity("d-0", 200)  # budget: 100 blocks
    for i in range(3):
        put(s, A + f"a{i}", 10)  # A: 30 blocks, under its half
    for i in range(12):
        put(s, B + f"b{i}", 10)  # B asks for 120
    tenants = s.stats()["tenants"]
    assert tenants[B]["evicted_for_blocks"] == 5 and "evicted_for_blocks" not in tenants[A]
    assert tenants[A]["pinned_blocks"] == 30 and tenants[B]["pinned_blocks"] == 70
    assert all(has_handle(s, A + f"a{i}") for i in range(3))
    kept_b = [i for i in range(12) if has_handle(s, B + f"b{i}")]
    assert kept_b == list(range(5, 12))  # B's oldest went first, B holds the rest of the budget


def test_idle_share_is_lent_and_reclaimed_on_demand():
    s = store()
    s.set_engine_capacity("d-0", 200)
    for i in range(10):
        put(s, A + f"a{i}", 10)  # A alone: the whole budget
    assert s.stats()["tenants"][A]["pinned_blocks"] == 100 and s.counts["evicted_for_blocks"] == 0
    for i in range(5):
        put(s, B + f"b{i}", 10)  # B claims its half: A, over its share, gives way
    tenants = s.stats()["tenants"]
    assert tenants[A]["evicted_for_blocks"] == 5 and "evicted_for_blocks" not in tenants[B]
    assert tenants[A]["pinned_blocks"] == tenants[B]["pinned_blocks"] == 50
    assert [i for i in range(10) if has_handle(s, A + f"a{i}")] == list(range(5, 10))


def test_weights_set_the_shares():
    s = store(tenant_weights={A: 3.0})
    s.set_engine_capacity("d-0", 160)  # budget 80: A 60, B 20
    for i in range(8):
        put(s, A + f"a{i}", 10)
        put(s, B + f"b{i}", 10)
    tenants = s.stats()["tenants"]
    assert (tenants[A]["pinned_blocks"], tenants[B]["pinned_blocks"]) == (60, 20)


def test_a_tenant_at_its_live_session_limit_is_refused_a_new_one_until_one_goes_idle():
    """`max_sessions` bounds live sessions (used within the handle TTL, 100 s here): a new
    one past it is refused with the wait, claiming and storing nothing; the tenant's
    sessions that are live go on, other tenants are not limited, and a session idle past
    the window frees its place (it stays kept: its next turn continues it)."""
    now = [1000.0]
    s = store(tenant_max_sessions={A: 2}, clock=lambda: now[0])
    put(s, A + "a0", 1)
    now[0] += 30
    put(s, A + "a1", 1)
    refused = s.begin_turn(A + "a2")
    assert refused.retry_after_s == pytest.approx(70.0) and refused.handle is None
    assert s.stats()["open_leases"] == 0 and A + "a2" not in s._records
    assert s.stats()["tenants"][A]["sessions_refused"] == 1 and s.counts["sessions_refused"] == 1
    assert has_handle(s, A + "a0")  # a live session of the tenant goes on
    put(s, B + "b0", 1)  # another tenant is not limited by A's sessions
    now[0] += 90  # a0 and a1 were last used 90 s ago: still live
    assert s.begin_turn(A + "a2").retry_after_s == pytest.approx(10.0)
    now[0] += 11  # both idle past the window now
    put(s, A + "a2", 1)
    assert s.stats()["tenants"][A]["sessions"] == 3  # idle ones stay kept
    claim = s.begin_turn(A + "a1")  # and an idle session's next turn continues it (its
    assert claim.retry_after_s is None and claim.conversation is not None  # handle expired)


def test_shares_victim_is_the_tenant_most_over_its_weighted_share():
    shares = TenantShares({A: 2.0})
    for tenant, session, blocks in ((A, "a1", 30), (A, "a2", 30), (B, "b1", 40)):
        shares.hold("e", tenant, blocks)
        shares.stored("e", tenant, session)
    assert shares.victim("e") == "b1"  # 40/1 > 60/2
    shares.unstored("e", B, "b1")
    assert shares.victim("e") == "a1"  # only A has stored handles left
    assert shares.victim("other") is None


def test_store_settings_split_tenant_limits_among_shards():
    settings = StoreSettings(
        1, 2, 10, 10, 4, shards=4, tenant_weights=((A, 2.0),), tenant_max_sessions=((A, 10),)
    )
    kwargs = settings.store_kwargs()
    assert kwargs["tenant_weights"] == {A: 2.0} and kwargs["tenant_max_sessions"] == {A: 3}


# -- quotas ---------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def tenant(**policy):
    return ApiKeys(("key-a",), {"key-a": TenantPolicy(**policy)}).tenant("Bearer key-a")


def test_concurrent_turns_beyond_the_limit_are_refused_and_slots_come_back():
    quotas, t = Quotas(), tenant(max_concurrent_turns=2)
    with quotas.admit(t, 10), quotas.admit(t, 10):
        with pytest.raises(APIError) as refused:
            with quotas.admit(t, 10):
                pass
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    assert refused.value.body()["error"]["code"] == "rate_limit_exceeded"
    assert quotas.in_flight() == {}
    with pytest.raises(RuntimeError):  # a turn that fails gives its slot back too
        with quotas.admit(t, 10):
            raise RuntimeError("engine gone")
    with quotas.admit(t, 10), quotas.admit(t, 10):
        pass
    assert quotas.refused == {(t.label, "concurrent_turns"): 1}


def test_prompt_tokens_per_minute_with_retry_after():
    clock = Clock()
    quotas, t = Quotas(clock=clock), tenant(prompt_tokens_per_minute=1000)
    with quotas.admit(t, 600):
        pass
    clock.now += 10
    with quotas.admit(t, 300):
        pass
    clock.now += 10
    with pytest.raises(APIError) as refused:
        with quotas.admit(t, 300):
            pass
    # Room for 300 comes back when the first turn (600 at t=100) leaves the window at t=160.
    assert refused.value.headers == {"Retry-After": "40"}
    clock.now += 40
    with quotas.admit(t, 300):
        pass
    # A single turn over the whole limit still runs when the window is empty.
    clock.now += 61
    with quotas.admit(t, 5000):
        pass


def test_limits_are_split_among_ingress_replicas_and_other_tenants_are_free():
    quotas = Quotas(ingress_replicas=2)
    t = tenant(max_concurrent_turns=4)
    other = ApiKeys(("key-a", "key-b")).tenant("Bearer key-b")
    with quotas.admit(t, 1), quotas.admit(t, 1):
        with pytest.raises(APIError):
            with quotas.admit(t, 1):
                pass
        with quotas.admit(other, 1), quotas.admit(other, 1), quotas.admit(other, 1):
            pass
