"""`connector.client.StoreClient`: shard handles fetched from the store deployment, checked
against the expected settings, fetched again after a failure; every call has a deadline.
Shards are the real `StoreShard` (`StoreShard(settings)`) in process, called as actors
are: `.remote()` calls return awaitables (no Ray)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from connector.client import StoreClient
from connector.settings import StoreSettings
from connector.shard import StoreShard, apply_ops
from connector.shard_queue import ShardQueue
from connector.store import TurnOutcome
from connector.store_api import StoreApi, StoreOp, StoreUnavailable

SETTINGS = StoreSettings(
    handle_ttl_s=10, decoder_ttl_s=20, max_sessions=10, max_blocks_per_engine=100, index_block_size=4
)


class _Method:
    def __init__(self, shard, name):
        self._shard, self._name = shard, name

    def remote(self, *args):
        async def call():
            if self._shard.hang:
                await asyncio.sleep(3600)
            if self._shard.dead:
                raise ray.exceptions.RayActorError()
            self._shard.calls += 1
            return getattr(self._shard.shard, self._name)(*args)

        return call()


class FakeShard:
    """A shard actor that can hang or die: `StoreShard(settings)` behind `.remote()`."""

    def __init__(self):
        self.shard = StoreShard(SETTINGS)
        self.store = self.shard.store
        self.hang = False
        self.dead = False
        self.calls = 0

    def __getattr__(self, name):
        return _Method(self, name)


class Source:
    def __init__(self, settings=SETTINGS):
        self.settings = settings
        self.shards = [FakeShard()]
        self.fetches = 0

    async def __call__(self):
        self.fetches += 1
        return self.settings, self.shards


async def test_shards_are_fetched_once_and_used_directly():
    source = Source()
    client = StoreClient(source, SETTINGS)
    claim = await client.begin_turn("s1")
    assert (await client.stats())["shards"][0]["open_leases"] == 1
    await client.end_turn(claim, TurnOutcome.UNUSED, None)
    assert (await client.stats())["shards"][0]["open_leases"] == 0
    assert source.fetches == 1


async def test_a_store_with_other_settings_is_refused_until_it_has_ours():
    source = Source(StoreSettings(**{**SETTINGS.__dict__, "handle_ttl_s": 5}))
    client = StoreClient(source, SETTINGS)
    with pytest.raises(StoreUnavailable, match="settings"):
        await client.begin_turn("s1")
    source.settings = SETTINGS  # the redeploy finished
    await client.begin_turn("s1")
    assert source.fetches == 2


async def test_a_late_call_is_unavailable_and_the_shards_are_fetched_again():
    source = Source()
    client = StoreClient(source, SETTINGS, timeout_s=0.05)
    await client.stats()
    source.shards[0].hang = True
    with pytest.raises(StoreUnavailable):
        await client.begin_turn("s1")
    source.shards = [FakeShard()]  # a new store replica with new shards
    await client.begin_turn("s1")
    assert source.fetches == 2


async def test_a_dead_shard_is_unavailable():
    source = Source()
    client = StoreClient(source, SETTINGS)
    source.shards[0].dead = True
    with pytest.raises(StoreUnavailable, match="failed"):
        await client.match([1, 2, 3])


async def test_an_engine_budget_is_split_among_the_shards():
    source = Source()
    source.shards = [FakeShard(), FakeShard(), FakeShard()]
    client = StoreClient(source, SETTINGS)
    await client.set_engine_capacity("d-0", 300)
    # pinned_fraction 0.5 of 100 blocks each: three shards together keep at most 150.
    assert [s.store._pins.budget("d-0") for s in source.shards] == [50, 50, 50]


async def test_concurrent_turns_share_round_trips_and_keep_their_order():
    source = Source()
    client = StoreClient(source, SETTINGS)
    await client.stats()
    shard = source.shards[0]
    calls = shard.calls
    claims = await asyncio.gather(*(client.begin_turn(f"s{i}") for i in range(64)))
    # Issued in one tick of the event loop: split among the senders, a round trip each
    # for 16 turns, and run by the shard in the order they were issued.
    assert shard.calls - calls == ShardQueue.MAX_IN_FLIGHT == 4
    assert [c.session_id for c in claims] == [f"s{i}" for i in range(64)]
    assert [c.lease_id for c in claims] == sorted(c.lease_id for c in claims)
    await asyncio.gather(*(client.end_turn(claim, TurnOutcome.UNUSED, None) for claim in claims[8:]))
    claims = claims[:8]
    assert (await client.stats())["shards"][0]["open_leases"] == 8
    # An end and the next begin of one session, issued together, run in that order.
    calls = shard.calls
    await asyncio.gather(client.end_turn(claims[0], TurnOutcome.UNUSED, None), client.begin_turn("s0"))
    assert shard.calls - calls <= 2
    assert (await client.stats())["shards"][0]["open_leases"] == 8


async def test_a_failed_batch_fails_each_of_its_turns_and_the_next_batch_goes_out():
    source = Source()
    client = StoreClient(source, SETTINGS, timeout_s=0.05)
    await client.stats()
    source.shards[0].hang = True
    results = await asyncio.gather(*(client.begin_turn(f"s{i}") for i in range(4)), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailable) for r in results), results
    source.shards = [FakeShard()]
    assert (await client.begin_turn("s1")).session_id == "s1"


def test_every_declared_operation_is_implemented_and_reached_by_the_client():
    """One declaration (`StoreOp`): each names a method of its shard part, the client has
    a method of that name, and the client's methods are exactly the `StoreApi`."""
    shard = StoreShard(SETTINGS)
    for op in StoreOp:
        assert callable(getattr(shard._parts[op.part], op.method)), op
        assert callable(getattr(StoreClient, op.value)), op
    assert {n for n in dir(StoreApi) if not n.startswith("_")} == {op.value for op in StoreOp}


def test_one_operation_failing_leaves_the_rest_of_its_batch_applied():
    store = SETTINGS.handle_store()
    results = apply_ops(store, [("begin_turn", ("a",)), ("drop_engine", ("d-0",)), ("begin_turn", ("b",))])
    assert [ok for ok, _ in results] == [True, False, True]
    assert isinstance(results[1][1], ValueError)
    assert store.stats()["open_leases"] == 2


def test_the_store_byte_bound_is_split_among_the_shards():
    settings = StoreSettings(**{**SETTINGS.__dict__, "shards": 4, "max_store_bytes": 8 << 30})
    assert settings.store_kwargs()["max_store_bytes"] == 2 << 30
    assert "shards" not in settings.store_kwargs()


async def test_a_batch_that_cannot_be_sent_fails_its_turns_instead_of_leaving_them_waiting():
    source = Source()
    client = StoreClient(source, SETTINGS, timeout_s=5)
    await client.stats()

    class NoApply(FakeShard):
        def __getattr__(self, name):
            if name == "apply":  # e.g. a shard of an older release
                raise AttributeError(name)
            return super().__getattr__(name)

    client._queues[0]._actor = NoApply()
    results = await asyncio.wait_for(
        asyncio.gather(client.begin_turn("a"), client.begin_turn("b"), return_exceptions=True), 1
    )
    assert all(isinstance(r, StoreUnavailable) for r in results), results


async def test_the_conversation_an_ingress_stored_is_not_shipped_back_to_it():
    from connector.handle import KVHandle, Location
    from connector.store import Conversation

    source = Source()
    client = StoreClient(source, SETTINGS)
    handle = KVHandle(
        location=Location.DECODE,
        engine_id="d-0",
        request_id="req-1",
        block_ids=((1, 2),),
        host="h",
        port=1,
        num_tokens=7,
    )
    mine = Conversation("s1", tuple(range(1, 9)), 6, None, handle, "decode#0")
    claim = await client.begin_turn("s1")
    await client.end_turn(claim, TurnOutcome.UNUSED, mine)
    claim = await client.begin_turn("s1")
    # The shard said "the one you hold": the client's own copy, the shard's handle.
    assert claim.conversation is mine and claim.handle == handle
    # A client that does not hold it (another ingress replica) gets it from the shard.
    other = await StoreClient(source, SETTINGS).begin_turn("s1")
    assert other.conversation is not mine and other.conversation.token_ids == mine.token_ids


async def test_a_turn_that_extends_its_claim_travels_as_its_tail():
    from connector.handle import KVHandle, Location
    from connector.store import Conversation, ConversationTail

    source = Source()
    sent = []
    store = source.shards[0].store
    end_turn = store.end_turn
    store.end_turn = lambda lease, outcome, c, blocks=None, retain=False: (
        sent.append(c),
        end_turn(lease, outcome, c, blocks, retain),
    )[1]
    client = StoreClient(source, SETTINGS)

    def handle(n):
        return KVHandle(
            location=Location.DECODE,
            engine_id="d-0",
            request_id=f"req-{n}",
            block_ids=((1, 2),),
            host="h",
            port=1,
            num_tokens=7,
        )

    first = Conversation("s1", tuple(range(1, 9)), 6, "abcdefgh", handle(1), "decode#0")
    await client.end_turn(await client.begin_turn("s1"), TurnOutcome.UNUSED, first)
    second = Conversation("s1", first.token_ids + (20, 21, 22), 10, first.text + "xyz", handle(2), "decode#0")
    await client.end_turn(await client.begin_turn("s1"), TurnOutcome.PULLED, second)
    # A turn that rewrote its history goes whole.
    edited = Conversation(
        "s1", (5,) + second.token_ids[1:] + (30,), 11, "Z" + second.text[1:] + "w", handle(3), "decode#0"
    )
    await client.end_turn(await client.begin_turn("s1"), TurnOutcome.PULLED, edited)
    assert isinstance(sent[0], Conversation)  # nothing claimed before: whole
    assert (
        isinstance(sent[1], ConversationTail) and tuple(sent[1].ids) == (20, 21, 22) and sent[1].text == "xyz"
    )
    assert isinstance(sent[2], Conversation)
    # What another ingress replica reads back is each turn whole.
    claim = await StoreClient(source, SETTINGS).begin_turn("s1")
    assert claim.conversation == edited and store.counts.get("tail_mismatch", 0) == 0


async def test_a_retained_turn_keeps_its_handle_over_a_newer_one_past_the_budget():
    from connector.handle import KVHandle, Location
    from connector.store import Conversation

    def conversation(session, n):
        handle = KVHandle(Location.DECODE, "d-0", f"req-{n}", (tuple(range(60)),), "h", 1, 7)
        return Conversation(session, tuple(range(1, 9)), 6, None, handle, "decode#0")

    client = StoreClient(Source(), SETTINGS)
    await client.end_turn(
        await client.begin_turn("old"), TurnOutcome.UNUSED, conversation("old", 1), retain=True
    )
    await client.end_turn(await client.begin_turn("new"), TurnOutcome.UNUSED, conversation("new", 2))
    # 120 blocks waiting, over the budget of 100: the one not retained goes.
    assert (await client.begin_turn("new")).miss_reason == "evicted"
    assert (await client.begin_turn("old")).handle is not None
