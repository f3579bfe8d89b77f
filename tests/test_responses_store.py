"""`connector.response_store.ResponseStore` on a fake clock, and the same store through
`StoreClient` over the real shards (`StoreShard(settings)`) run in process
(`StoreClient.of_shards`: `.remote()` calls are awaitables, no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from connector.client import StoreClient
from connector.response_store import ResponseStore, StoredResponse, route_of
from connector.settings import StoreSettings
from connector.shard import StoreShard

A, B = "k0123456789ab:", "kba9876543210:"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


def resp(key: str, text: str = "hi") -> StoredResponse:
    return StoredResponse(
        key=key,
        session_id=f"sess-{key}",
        created_at=0.0,
        body={"id": key, "output_text": text},
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
        input_items=[{"type": "message", "content": "q"}],
    )


def store(clock, max_responses=100, max_bytes=1 << 20, ttl_s=60.0) -> ResponseStore:
    # The handle store's settings (the first five) play no part here.
    settings = StoreSettings(1, 2, 1, 1, 1, max_responses=max_responses, max_response_bytes=max_bytes)
    return settings.response_store(ttl_s=ttl_s, clock=clock)


def test_size_is_the_json_size_counted_once():
    r = resp("resp_1")
    assert r.nbytes > len('"output_text":"hi"')
    big = resp("resp_2", "x" * 1000)
    assert big.nbytes - r.nbytes == 2 * 998  # the text is in the body and in the messages


def test_the_count_bound_evicts_the_least_recently_used(clock):
    s = store(clock, max_responses=2)
    assert s.put(resp("r1")) == s.put(resp("r2")) == "stored"
    assert s.get("r1") is not None  # r2 is now the least recently used
    s.put(resp("r3"))
    assert s.get("r2") is None and s.get("r1") is not None and s.get("r3") is not None
    assert s.counts["responses_evicted"] == 1 and s.counts["responses_evicted_for_bytes"] == 0
    assert s.stats()["responses"] == 2


def test_the_byte_bound_evicts_the_least_recently_used(clock):
    one = resp("r1").nbytes
    s = store(clock, max_bytes=2 * one + one // 2)
    s.put(resp("r1"))
    s.put(resp("r2"))
    s.put(resp("r3"))
    assert s.get("r1") is None and s.get("r2") is not None
    assert s.counts["responses_evicted_for_bytes"] == 1 and s.counts["responses_evicted"] == 0
    assert s.stats()["response_bytes"] == 2 * one


def test_a_response_larger_than_the_byte_bound_is_refused_and_the_kept_one_stays(clock):
    s = store(clock, max_bytes=resp("r1").nbytes + 10)
    assert s.put(resp("r1")) == "stored"
    assert s.put(resp("r1", "x" * 100)) == "too_big"
    assert s.get("r1") == resp("r1")
    assert s.counts["responses_refused_too_big"] == 1 and s.counts["responses_stored"] == 1


def test_replacing_a_key_keeps_one_and_counts_its_bytes_once(clock):
    s = store(clock)
    s.put(resp("r1"))
    s.put(resp("r1", "longer text"))
    assert s.stats()["responses"] == 1 and s.stats()["response_bytes"] == resp("r1", "longer text").nbytes


def test_responses_unused_for_the_ttl_expire_and_a_use_restarts_it(clock):
    s = store(clock, ttl_s=60)
    s.put(resp("r1"))
    s.put(resp("r2"))
    clock.now += 50
    assert s.get("r1") is not None  # used: its TTL starts again
    clock.now += 20
    assert s.get("r2") is None and s.get("r1") is not None
    assert s.counts["responses_expired"] == 1
    clock.now += 60
    assert s.stats()["responses"] == 0 and s.counts["responses_expired"] == 2


def test_the_first_continuation_owns_and_a_second_forks(clock):
    s = store(clock)
    s.put(resp("r1"))
    found, owns = s.continue_from("r1", "req-a")
    assert found is not None and owns and found.continued_by == "req-a"
    assert s.continue_from("r1", "req-a")[1]  # the same request again (a retry)
    found, owns = s.continue_from("r1", "req-b")
    assert found is not None and not owns and found.continued_by == "req-a"
    assert s.counts["responses_forked"] == 1
    assert s.continue_from("missing", "req-c") == (None, False)


def test_a_released_continuation_can_be_owned_by_a_later_request(clock):
    s = store(clock)
    s.put(resp("r1"))
    s.continue_from("r1", "req-a")
    s.release_continuation("r1", "req-b")  # not its owner: nothing changes
    assert not s.continue_from("r1", "req-c")[1]
    s.release_continuation("r1", "req-a")
    assert s.continue_from("r1", "req-c")[1]


def test_delete(clock):
    s = store(clock)
    s.put(resp("r1"))
    assert s.delete("r1") == resp("r1")
    assert s.delete("r1") is None and s.get("r1") is None
    assert s.counts["responses_deleted"] == 1 and s.stats()["response_bytes"] == 0


def test_kept_responses_are_counted_per_tenant_namespace(clock):
    s = store(clock, max_responses=3)
    for key in (A + "r1", A + "r2", B + "r1", "r1"):
        s.put(resp(key))  # the fourth evicts A's first
    assert s.stats()["response_tenants"] == {A: 1, B: 1, "": 1}
    s.delete(B + "r1")
    assert s.stats()["response_tenants"] == {A: 1, "": 1}


# -- through the store client and the shards ----------------------------------------------------


SETTINGS = StoreSettings(
    handle_ttl_s=10,
    decoder_ttl_s=20,
    max_sessions=10,
    max_blocks_per_engine=100,
    index_block_size=4,
    shards=2,
    max_responses=10,
    max_response_bytes=1 << 20,
    response_ttl_s=600,
)


def test_store_settings_split_the_response_bounds_and_keep_them_from_the_handle_store():
    assert SETTINGS.response_kwargs() == {"max_responses": 5, "max_bytes": 1 << 19, "ttl_s": 600}
    assert not {"max_responses", "max_response_bytes", "response_ttl_s"} & set(SETTINGS.store_kwargs())


async def test_responses_through_the_client_live_on_the_shard_their_key_hashes_to():
    client = StoreClient.of_shards([StoreShard(SETTINGS) for _ in range(SETTINGS.shards)])
    keys = [f"{A}resp_{i}" for i in range(8)]
    assert set(await asyncio.gather(*(client.put_response(resp(k)) for k in keys))) == {"stored"}
    shards = (await client.stats())["shards"]
    assert all(s["responses"]["responses"] for s in shards)  # both shards hold some
    assert sum(s["responses"]["responses"] for s in shards) == 8
    assert shards[0]["settings"]["responses"]["max_responses"] == 5

    assert await client.get_response(keys[0]) == resp(keys[0])
    first, owns = await client.continue_response(keys[0], "req-a")
    assert first is not None and first.key == keys[0] and first.continued_by == "req-a" and owns
    assert (await client.continue_response(keys[0], "req-b"))[1] is False
    await client.release_continuation(keys[0], "req-a")
    assert (await client.continue_response(keys[0], "req-b"))[1] is True
    assert await client.delete_response(keys[0]) is not None
    assert await client.get_response(keys[0]) is None


def link(key: str, parent: str | None, text: str) -> StoredResponse:
    return StoredResponse(
        key=key,
        session_id="sess",
        created_at=0.0,
        body={"id": key},
        messages=[{"role": "user", "content": "q " + text}, {"role": "assistant", "content": text}],
        input_items=[],
        parent_key=parent,
    )


def test_a_chain_keeps_each_response_s_own_messages_and_rebuilds_the_history(clock):
    s = store(clock)
    assert s.put(link("r1", None, "one")) == "stored"
    assert s.put(link("r2", "r1", "two")) == "stored"
    assert s.put(link("r3", "r2", "three")) == "stored"
    assert [m["content"] for m in s.get("r3").history()] == [
        "q one",
        "one",
        "q two",
        "two",
        "q three",
        "three",
    ]
    # A fork from r1 shares r1's history, not r2's.
    assert s.put(link("r2b", "r1", "fork")) == "stored"
    assert [m["content"] for m in s.get("r2b").history()] == ["q one", "one", "q fork", "fork"]
    # Bytes grow with what each response added, not with the history it extends.
    assert s.get("r3").nbytes == link("r3", "r2", "three").nbytes
    # The parent forgotten by the bounds: its child still has the whole history.
    s.delete("r1")
    assert [m["content"] for m in s.get("r2").history()][:2] == ["q one", "one"]
    detached = s.get("r3").detached()
    assert detached.parent is None and detached.parent_key is None and len(detached.messages) == 6


def test_a_response_whose_parent_is_gone_is_refused_until_sent_alone(clock):
    s = store(clock)
    assert s.put(link("r2", "r1", "two")) == "no_parent"
    assert s.get("r2") is None


async def test_the_client_stores_a_response_alone_when_its_shard_lost_the_parent():
    client = StoreClient.of_shards([StoreShard(SETTINGS) for _ in range(SETTINGS.shards)])
    history = [{"role": "user", "content": "q one"}, {"role": "assistant", "content": "one"}]
    assert (
        await client.put_response(
            link(f"{A}resp_{'a' * 32}", f"{A}resp_{'a' * 16}{'b' * 16}", "two"), history
        )
        == "stored"
    )
    kept = await client.get_response(f"{A}resp_{'a' * 32}")
    assert [m["content"] for m in kept.messages] == ["q one", "one", "q two", "two"]


def test_responses_of_one_chain_route_together():
    first = f"{A}resp_{'1' * 16}{'2' * 16}"
    child = f"{A}resp_{'1' * 16}{'3' * 16}"
    assert route_of(first) == route_of(child) == f"{A}resp_{'1' * 16}"
    assert route_of(f"{A}resp_short") == f"{A}resp_short"
