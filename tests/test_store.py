"""`connector.store.HandleStore` driven directly, on a fake clock."""

from __future__ import annotations

from array import array
from collections import OrderedDict

import pytest

from connector.events import Miss, StoreEvent
from connector.handle import KVHandle, Location
from connector.records import LIVE_STATES, OUTCOME_STATE, TRANSITIONS
from connector.settings import StoreSettings
from connector.store import (
    Conversation,
    ConversationTail,
    HandleState,
    HandleStore,
    TurnOutcome,
    chain_hashes,
    common_prefix_len,
    restrict,
)

TTL = 100.0
DECODER_TTL = 150.0
BLOCK = 4
TEXT_BLOCK = 4


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


SETTINGS = StoreSettings(
    handle_ttl_s=TTL,
    decoder_ttl_s=DECODER_TTL,
    max_sessions=100,
    max_blocks_per_engine=1000,
    index_block_size=BLOCK,
)


def make_store(clock, **kwargs) -> HandleStore:
    """A shard's store as the settings build it; `kwargs` replace or add its arguments."""
    return SETTINGS.handle_store(
        **{"text_block_chars": TEXT_BLOCK, "lease_timeout_s": 50.0, "clock": clock, **kwargs}
    )


@pytest.fixture
def store(clock):
    return make_store(clock)


_handle_ids = iter(range(1, 1_000_000))


def handle(engine="d-0", blocks=3, num_tokens=None) -> KVHandle:
    n = next(_handle_ids)
    return KVHandle(
        location=Location.DECODE,
        engine_id=engine,
        request_id=f"req-{n}",
        block_ids=(tuple(range(n * 10, n * 10 + blocks)),),
        host="10.0.0.2",
        port=5601,
        num_tokens=blocks * BLOCK - 1 if num_tokens is None else num_tokens,
    )


def conv(session, prompt, answer=(), *, engine="d-0", blocks=3, with_handle=True) -> Conversation:
    ids = tuple(prompt) + tuple(answer)
    return Conversation(
        session_id=session,
        token_ids=ids,
        prompt_len=len(prompt),
        text=None,
        handle=handle(engine, blocks, num_tokens=len(ids) - 1) if with_handle else None,
        decode_replica="decode#0",
    )


# -- lifecycle -----------------------------------------------------------------------------


def test_begin_turn_without_conversation(store):
    claim = store.begin_turn("s")
    assert claim.handle is None and claim.conversation is None
    assert claim.miss_reason == "no_conversation"
    assert store.counts["miss_no_conversation"] == 1
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    assert store.stats()["open_leases"] == 0
    assert store.stats()["sessions"] == 0


def test_claim_is_single_use(store):
    c = conv("s", range(10), range(100, 105))
    store.put(c)
    first = store.begin_turn("s")
    assert first.handle is c.handle
    assert first.conversation == c
    assert first.miss_reason is None
    assert store.stats()["handles"] == {"claimed": 1}
    assert store.stats()["claimed_handles"] == 1

    second = store.begin_turn("s")
    assert second.handle is None
    assert second.miss_reason == "claimed"
    assert second.conversation == c  # the text/ids are still there for splicing
    assert second.lease_id != first.lease_id
    assert store.counts["claimed"] == 1
    assert store.counts["miss_claimed"] == 1
    assert store.stats()["open_leases"] == 2
    assert store.stats()["claimed_handles"] == 1


@pytest.mark.parametrize("outcome", [o for o in TurnOutcome if o is not TurnOutcome.KEPT])
def test_end_turn_outcome_is_recorded(store, outcome):
    store.put(conv("s", range(10), range(100, 105)))
    claim = store.begin_turn("s")
    store.end_turn(claim.lease_id, outcome, None)
    assert store.counts[outcome.value] == 1
    assert store.stats()["handles"] == {outcome.value: 1}
    assert store.stats()["claimed_handles"] == 0
    # Settled handles are never handed out again.
    again = store.begin_turn("s")
    assert again.handle is None and again.miss_reason == outcome.value


def test_end_turn_stores_next_conversation(store):
    first = conv("s", range(10), range(100, 105))
    store.put(first)
    claim = store.begin_turn("s")
    nxt = conv("s", first.token_ids + (7, 8), range(200, 203))
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, nxt)
    assert store.counts["pulled"] == 1
    assert store.counts["stored"] == 2
    claim2 = store.begin_turn("s")
    assert claim2.handle is nxt.handle
    assert claim2.conversation.token_ids == nxt.token_ids


def test_end_turn_twice_is_late(store):
    store.put(conv("s", range(10)))
    claim = store.begin_turn("s")
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, None)
    store.end_turn(claim.lease_id, TurnOutcome.FAILED, None)
    assert store.counts["late_end_turn"] == 1
    assert store.counts["pulled"] == 1
    assert store.counts["failed"] == 0


def test_a_kept_claim_gives_the_handle_back_as_it_was(store, clock):
    store.put(conv("main", range(10), range(100, 105)))
    clock.advance(1)
    store.put(conv("later", range(50, 60)))
    pinned = store.pinned_blocks("d-0")
    claim = store.begin_turn("main")
    store.end_turn(claim.lease_id, TurnOutcome.KEPT, None)
    assert store.counts["given_back"] == 1 and store.counts["unused"] == 0
    stats = store.stats()
    assert stats["claimed_handles"] == 0 and stats["open_leases"] == 0
    assert stats["handles"] == {"stored": 2} and store.pinned_blocks("d-0") == pinned
    assert store.take_releases() == []  # nothing goes back to the engine
    again = store.begin_turn("main")
    assert again.handle is claim.handle and again.conversation == claim.conversation
    store.end_turn(again.lease_id, TurnOutcome.KEPT, None)
    # Still in expiry order: "main" (stored first) expires first, "later" a second after.
    clock.advance(TTL - 0.5)
    assert store.begin_turn("main").handle is None
    assert store.counts["expired"] == 1
    later = store.begin_turn("later")
    assert later.handle is not None


def test_a_kept_claim_of_an_expired_handle_settles_it_unused(store, clock):
    store.put(conv("main", range(10), range(100, 105)))
    claim = store.begin_turn("main")
    clock.advance(TTL + 1)
    store.end_turn(claim.lease_id, TurnOutcome.KEPT, None)
    assert store.counts["given_back"] == 0 and store.stats()["claimed_handles"] == 0


def test_new_conversation_supersedes_stored_handle(store, clock):
    old = conv("s", range(10), blocks=2)
    store.put(old)
    new = conv("s", range(20), blocks=5)
    store.put(new)
    assert store.counts["superseded"] == 1
    assert store.stats()["handles"] == {"stored": 1}
    # The superseded blocks stay pinned on the engine until its own TTL.
    assert store.pinned_blocks("d-0") == 5 + 2
    clock.advance(TTL - 1)
    assert store.pinned_blocks("d-0") == 5 + 2
    claim = store.begin_turn("s")
    assert claim.handle is new.handle
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, None)
    assert store.pinned_blocks("d-0") == 2
    clock.advance(DECODER_TTL - TTL + 1)
    assert store.pinned_blocks("d-0") == 0


def test_put_over_claimed_does_not_count_superseded(store):
    store.put(conv("s", range(10)))
    claim = store.begin_turn("s")
    store.put(conv("s", range(12)))
    assert store.counts["superseded"] == 0
    # The lease still settles its handle.
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    assert store.counts["unused"] == 1


def test_conversation_without_handle(store):
    store.put(conv("s", range(10), with_handle=False))
    claim = store.begin_turn("s")
    assert claim.handle is None and claim.miss_reason == "no_handle"
    assert claim.conversation.token_ids == tuple(range(10))
    assert store.counts["stored"] == 0


# -- expiry and bounds -------------------------------------------------------------------


def test_handle_expires_after_ttl(store, clock):
    store.put(conv("a", range(10)))
    store.put(conv("b", range(10)))
    clock.advance(TTL - 0.5)
    assert store.begin_turn("a").handle is not None
    clock.advance(0.5)
    claim = store.begin_turn("b")
    assert claim.handle is None
    assert claim.miss_reason == "expired"
    assert store.counts["expired"] == 1
    assert store.counts["miss_expired"] == 1
    # The claimed one was not expired under its lease.
    assert store.stats()["handles"] == {"claimed": 1, "expired": 1}


def test_expired_blocks_counted_until_decoder_ttl(store, clock):
    store.put(conv("s", range(10), blocks=4))
    clock.advance(TTL)
    assert store.stats()["handles"] == {"expired": 1}
    assert store.pinned_blocks("d-0") == 4
    clock.advance(DECODER_TTL - TTL - 0.1)
    assert store.pinned_blocks("d-0") == 4
    clock.advance(0.1)
    assert store.pinned_blocks("d-0") == 0


def test_max_sessions_evicts_least_recently_used(clock):
    store = make_store(clock, max_sessions=2)
    store.put(conv("a", range(10), blocks=1))
    clock.advance(1)
    store.put(conv("b", range(10), blocks=1))
    clock.advance(1)
    store.begin_turn("a")  # touches a: b is now least recently used
    clock.advance(1)
    store.put(conv("c", range(10), blocks=1))
    assert store.stats()["sessions"] == 2
    assert store.counts["sessions_evicted"] == 1
    assert store.counts["evicted"] == 1
    assert store.begin_turn("b").miss_reason == "no_conversation"
    assert store.begin_turn("c").handle is not None
    # b's blocks were left unread: still pinned until the decoder frees them.
    assert store.pinned_blocks("d-0") == 3


def test_block_bound_evicts_oldest_handles_on_that_engine(clock):
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv("a", range(10), blocks=4))
    clock.advance(1)
    store.put(conv("other", range(10), blocks=8, engine="d-1"))
    clock.advance(1)
    store.put(conv("b", range(10), blocks=4))
    clock.advance(1)
    store.put(conv("c", range(10), blocks=4))  # 12 > 10 on d-0: the oldest goes
    assert store.counts["evicted_for_blocks"] == 1
    assert store.begin_turn("a").miss_reason == "evicted"
    assert store.begin_turn("b").handle is not None
    assert store.begin_turn("c").handle is not None
    # Another engine's handles are untouched by d-0's bound.
    assert store.begin_turn("other").handle is not None
    # a's blocks are still pinned (unread) until the decoder's TTL.
    assert store.pinned_blocks("d-0") == 4 + 4 + 4


def test_block_bound_ignores_blocks_it_cannot_free(clock):
    """Unread blocks of handles that already left stay pinned whatever the store does:
    they must not make it evict the handles still waiting."""
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv("a", range(10), blocks=8))
    store.put(conv("a", range(12), blocks=8))  # supersedes: 8 abandoned + 8 waiting
    assert store.counts["evicted_for_blocks"] == 0
    store.put(conv("b", range(10), blocks=2))  # 10 waiting
    assert store.counts["evicted_for_blocks"] == 0
    assert store.begin_turn("a").handle is not None
    assert store.begin_turn("b").handle is not None
    assert store.pinned_blocks("d-0") == 18


def test_block_bound_evicts_a_handle_larger_than_the_bound(clock):
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv("a", range(10), blocks=2))
    store.put(conv("huge", range(10), blocks=11))
    assert store.counts["evicted_for_blocks"] == 2
    assert store.begin_turn("huge").miss_reason == "evicted"
    assert store.begin_turn("a").miss_reason == "evicted"


def test_block_bound_evicts_a_conversation_not_retained_before_an_older_retained_one(clock):
    store = make_store(clock, max_blocks_per_engine=10)
    claim = store.begin_turn("old")
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, conv("old", range(10), blocks=6), retain=True)
    clock.advance(1)
    store.put(conv("new", range(10), blocks=6))  # 12 > 10: the one not retained goes
    assert store.begin_turn("new").miss_reason == "evicted"
    assert store.begin_turn("old").handle is not None
    assert store.counts[StoreEvent.EVICTED_FOR_BLOCKS] == 1 and store.counts[StoreEvent.EVICTED_RETAINED] == 0


def test_block_bound_evicts_the_oldest_retained_when_all_are_retained(clock):
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv("a", range(10), blocks=4), retain=True)
    clock.advance(1)
    store.put(conv("b", range(10), blocks=4), retain=True)
    clock.advance(1)
    store.put(conv("c", range(10), blocks=4), retain=True)
    assert store.begin_turn("a").miss_reason == "evicted"
    assert store.begin_turn("b").handle is not None and store.begin_turn("c").handle is not None
    assert store.counts[StoreEvent.EVICTED_FOR_BLOCKS] == 1 and store.counts[StoreEvent.EVICTED_RETAINED] == 1


def test_retention_does_not_change_which_tenant_gives_up_blocks(clock):
    """B is over its share: its retained conversation goes before A's plain one."""
    a, b = "k0123456789ab:", "kba9876543210:"
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv(a + "1", range(10), blocks=3))
    store.put(conv(b + "1", range(10), blocks=6), retain=True)
    store.put(conv(a + "2", range(10), blocks=3))  # 12 > 10: B holds the most
    assert store.begin_turn(b + "1").miss_reason == "evicted"
    assert store.counts[StoreEvent.EVICTED_RETAINED] == 1


def test_a_turn_stored_without_retain_is_no_longer_retained(clock):
    store = make_store(clock, max_blocks_per_engine=10)
    store.put(conv("a", range(10), blocks=4), retain=True)
    store.put(conv("b", range(10), blocks=4), retain=True)
    store.put(conv("b", range(12), blocks=4))  # b's next turn, plain
    store.put(conv("c", range(10), blocks=3), retain=True)  # 11 > 10: b is the only one not retained
    assert store.begin_turn("b").miss_reason == "evicted"
    assert store.begin_turn("a").handle is not None
    assert store.counts[StoreEvent.EVICTED_RETAINED] == 0


def test_pinned_blocks_for_abandoned_handles(store, clock):
    store.put(conv("s", range(10), blocks=6))
    assert store.pinned_blocks("d-0") == 6
    claim = store.begin_turn("s")
    assert store.pinned_blocks("d-0") == 6  # claimed: still pinned
    clock.advance(10)
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    # Not read: pinned until the decoder's TTL, counted from when it was stored.
    assert store.pinned_blocks("d-0") == 6
    assert store.stats()["pinned_blocks"] == {"d-0": 6}
    clock.advance(DECODER_TTL - 10 - 0.1)
    assert store.pinned_blocks("d-0") == 6
    clock.advance(0.1)
    assert store.pinned_blocks("d-0") == 0


def test_pulled_handle_is_not_pinned(store):
    store.put(conv("s", range(10), blocks=6))
    claim = store.begin_turn("s")
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, None)
    assert store.pinned_blocks("d-0") == 0


def test_lease_timeout_releases_claim(store, clock):
    store.put(conv("s", range(10), blocks=5))
    claim = store.begin_turn("s")
    assert store.stats()["claimed_handles"] == 1
    clock.advance(50.0)
    stats = store.stats()
    assert stats["open_leases"] == 0
    assert stats["claimed_handles"] == 0
    assert store.counts["lease_expired"] == 1
    # The blocks were never reported read: counted once, until the decoder's TTL.
    assert store.pinned_blocks("d-0") == 5
    late = store.begin_turn("s")
    assert late.handle is None and late.miss_reason == "expired"
    assert store.stats()["handles"] == {"expired": 1}
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, None)
    assert store.counts["late_end_turn"] == 1
    assert store.counts["pulled"] == 0
    clock.advance(DECODER_TTL)
    assert store.pinned_blocks("d-0") == 0


def test_drop_engine(store):
    store.put(conv("a", range(10), blocks=2, engine="d-0"))
    store.put(conv("b", range(10), blocks=2, engine="d-0"))
    store.put(conv("c", range(10), blocks=2, engine="d-1"))
    store.put(conv("a", range(12), blocks=3, engine="d-0"))  # supersedes: abandoned on d-0
    assert store.pinned_blocks("d-0") == 2 + 2 + 3
    assert store.drop_engine("d-0") == 2
    assert store.counts["dropped"] == 2
    assert store.pinned_blocks("d-0") == 0
    assert store.pinned_blocks("d-1") == 2
    assert store.begin_turn("a").miss_reason == "dropped"
    assert store.begin_turn("b").miss_reason == "dropped"
    assert store.begin_turn("c").handle is not None
    assert store.drop_engine("d-0") == 0


# -- moves: a stopping decode replica hands its conversations to a peer ------------------------


def test_moving_out_lists_the_engines_stored_sessions_most_recent_first(store, clock):
    for session in ("a", "b", "c"):
        store.put(conv(session, range(10), engine="d-0"))
        clock.advance(1)
    store.put(conv("x", range(10), engine="d-1"))
    store.end_turn(store.begin_turn("b").lease_id, TurnOutcome.PULLED, None)  # claimed and read
    assert [s for _, s in store.moving_out("d-0")] == ["c", "a"]
    assert store.moving_out("d-9") == []


def test_a_move_swaps_the_handle_and_keeps_the_conversation(store, clock):
    store.put(conv("a", range(10), (50, 51), engine="d-0", blocks=3), retain=True)
    claim = store.begin_move("a", "d-0")
    assert claim is not None and claim.handle is not None and claim.conversation is not None
    old = claim.handle
    # A turn arriving meanwhile finds the session moving, never the handle being read.
    turn = store.begin_turn("a")
    assert turn.handle is None and turn.miss_reason == Miss.MOVING == "moving"
    store.end_turn(turn.lease_id, TurnOutcome.UNUSED, None)
    assert store.pinned_blocks("d-0") == 3
    new = handle("d-1", blocks=3, num_tokens=old.num_tokens)
    assert store.end_move(claim.lease_id, new, "decode#1") == "moved"
    assert store.counts["moved"] == 1 and store.counts["moved_blocks"] == 3
    assert store.pinned_blocks("d-0") == 0 and store.pinned_blocks("d-1") == 3
    assert store.take_releases() == []  # the peer read the old blocks: the old engine frees them
    again = store.begin_turn("a")
    assert again.handle == new and again.conversation is not None
    assert again.conversation.decode_replica == "decode#1"
    assert again.conversation.token_ids == tuple(range(10)) + (50, 51)
    assert store._records["a"].retained
    assert store.moving_out("d-0") == []


def test_a_moved_conversation_keeps_its_age_and_its_copy_is_released_when_it_expires(store, clock):
    """A move is not a turn: the handle expires when it would have unmoved, before a
    conversation stored after it, and the peer's pin is released then (not at its TTL)."""
    store.put(conv("old", range(10), engine="d-0"))
    clock.advance(40)
    store.put(conv("young", range(20, 30), engine="d-1"))
    claim = store.begin_move("old", "d-0")
    assert claim is not None
    clock.advance(10)
    copy = handle("d-1", num_tokens=claim.handle.num_tokens)
    assert store.end_move(claim.lease_id, copy, "decode#1") == "moved"
    assert store.take_releases() == []
    clock.advance(TTL - 50 + 1)  # past the old conversation's expiry, not the young one's
    assert store.begin_turn("old").miss_reason == "expired"
    assert [(r.engine_id, r.request_id, r.reason) for r in store.take_releases()] == [
        ("d-1", copy.request_id, "expired")
    ]
    young = store.begin_turn("young")
    assert young.handle is not None


def test_a_failed_move_leaves_the_session_to_go_with_its_engine(store):
    store.put(conv("a", range(10), engine="d-0"))
    claim = store.begin_move("a", "d-0")
    assert claim is not None
    assert store.end_move(claim.lease_id, None, None) == "failed"
    assert store.counts["move_failed"] == 1
    assert store.begin_turn("a").miss_reason == "failed"


def test_a_turn_stored_during_a_move_wins_and_the_peers_copy_is_released(store):
    store.put(conv("a", range(10), engine="d-0"))
    claim = store.begin_move("a", "d-0")
    assert claim is not None
    # The turn waited no longer: it recomputed and stored its own conversation on d-2.
    turn = store.begin_turn("a")
    store.end_turn(turn.lease_id, TurnOutcome.UNUSED, conv("a", range(14), engine="d-2"))
    copy = handle("d-1", blocks=3)
    assert store.end_move(claim.lease_id, copy, "decode#1") == "superseded"
    assert store.counts["move_superseded"] == 1
    releases = store.take_releases()
    assert [(r.engine_id, r.request_id) for r in releases] == [("d-1", copy.request_id)]
    assert store.begin_turn("a").handle.engine_id == "d-2"


def test_a_session_ended_during_a_move_and_begun_again_is_not_told_moving(store):
    store.put(conv("a", range(10), engine="d-0"))
    claim = store.begin_move("a", "d-0")
    assert claim is not None
    assert store.end_session("a")
    first = store.begin_turn("a")  # the client's new conversation under the same id
    assert first.miss_reason == "no_conversation"
    store.end_turn(first.lease_id, TurnOutcome.UNUSED, conv("a", range(20, 30), engine="d-2"))
    second = store.begin_turn("a")
    assert second.handle is not None
    racing = store.begin_turn("a")  # a turn racing the second: its handle is claimed, not moving
    assert racing.handle is None and racing.miss_reason == "claimed", racing
    store.end_turn(racing.lease_id, TurnOutcome.UNUSED, None)
    store.end_turn(second.lease_id, TurnOutcome.PULLED, conv("a", range(20, 34), engine="d-2"))
    copy = handle("d-1", blocks=3)
    assert store.end_move(claim.lease_id, copy, "decode#1") == "superseded"
    assert [r.request_id for r in store.take_releases()] == [copy.request_id]
    assert store.begin_turn("a").handle.engine_id == "d-2"


def test_a_session_stays_moving_when_another_of_its_leases_expires(store, clock):
    store.put(conv("a", range(10), engine="d-0"))
    first = store.begin_turn("a")
    stale = store.begin_turn("a")  # told `claimed`; its client never ends it
    assert stale.miss_reason == "claimed"
    store.end_turn(first.lease_id, TurnOutcome.PULLED, conv("a", range(14), engine="d-0"))
    clock.advance(10)
    claim = store.begin_move("a", "d-0")
    assert claim is not None
    clock.advance(45)  # past the stale lease's deadline, not the move's
    turn = store.begin_turn("a")
    assert store.counts["lease_expired"] == 1
    assert turn.handle is None and turn.miss_reason == "moving", turn


def test_a_move_claims_only_a_handle_stored_on_the_draining_engine(store, clock):
    store.put(conv("a", range(10), engine="d-1"))
    assert store.begin_move("a", "d-0") is None
    assert store.begin_move("nobody", "d-0") is None
    store.put(conv("b", range(10), engine="d-0"))
    store.begin_turn("b")
    assert store.begin_move("b", "d-0") is None  # a turn holds it


def test_a_late_move_releases_the_copy(store, clock):
    store.put(conv("a", range(10), engine="d-0"))
    claim = store.begin_move("a", "d-0")
    assert claim is not None
    clock.advance(51)  # past the lease
    assert store.begin_turn("a").miss_reason == "expired"
    copy = handle("d-1")
    assert store.end_move(claim.lease_id, copy, "decode#1") == "late"
    # Both copies go: the old one (its lease expired unread) and the peer's.
    released = {(r.engine_id, r.request_id) for r in store.take_releases()}
    assert released == {("d-0", claim.handle.request_id), ("d-1", copy.request_id)}


# -- sessionless matching --------------------------------------------------------------------

SYSTEM = tuple(range(500, 508))  # two blocks


def test_match_requires_stored_prompt_as_prefix(store):
    prompt = SYSTEM + (1, 2, 3, 4)
    answer = (90, 91, 92)
    store.put(conv("s", prompt, answer))
    follow_up = prompt + answer + (5, 6, 7, 8)
    assert store.match(follow_up) == ("s", len(prompt) + len(answer))
    # Re-tokenized answer: still this session, agreeing up to the prompt.
    assert store.match(prompt + (60, 61, 62, 63)) == ("s", len(prompt))
    # The same prompt again (retry): agrees on the whole prompt.
    assert store.match(prompt) == ("s", len(prompt))


def test_match_rejects_diverging_prompt(store):
    prompt = SYSTEM + (1, 2, 3, 4)
    store.put(conv("s", prompt, (90, 91)))
    # Shares the system prompt's blocks, but the stored prompt is not a prefix.
    assert store.match(SYSTEM + (1, 2, 3, 9, 10, 11, 12, 13)) == (None, 0)
    # Unrelated.
    assert store.match(tuple(range(900, 920))) == (None, 0)
    # Shorter than the stored prompt.
    assert store.match(SYSTEM) == (None, 0)


def test_match_picks_deepest_session_sharing_system_prompt(store, clock):
    a_prompt = SYSTEM + (1, 1, 1, 1)
    b_prompt = SYSTEM + (2, 2, 2, 2)
    store.put(conv("a", a_prompt, (70, 71, 72, 73)))
    clock.advance(1)
    store.put(conv("b", b_prompt, (80, 81, 82, 83)))
    clock.advance(1)
    # b's next turn: longer prompt.
    b2_prompt = b_prompt + (80, 81, 82, 83) + (3, 3, 3, 3)
    store.put(conv("b2", b2_prompt, (84, 85)))
    clock.advance(1)
    store.put(conv("sys-only", SYSTEM, (99,)))

    assert store.match(a_prompt + (70, 71, 72, 73, 5, 5)) == ("a", len(a_prompt) + 4)
    assert store.match(b_prompt + (80, 81, 82, 83, 6, 6, 6, 6)) == ("b", len(b_prompt) + 4)
    assert store.match(b2_prompt + (84, 85, 9)) == ("b2", len(b2_prompt) + 2)
    # Only the system prompt in common with a/b: the session whose whole prompt is it.
    assert store.match(SYSTEM + (7, 7, 7, 7, 7)) == ("sys-only", len(SYSTEM))


def test_match_longest_agreement_at_same_depth(store, clock):
    prompt = SYSTEM + (1, 2, 3, 4)
    store.put(conv("short", prompt, (90,)))
    clock.advance(1)
    store.put(conv("long", prompt, (90, 91, 92)))
    clock.advance(1)
    store.put(conv("other", prompt, (50, 51, 52, 53)))
    assert store.match(prompt + (90, 91, 92, 93)) == ("long", len(prompt) + 3)
    assert store.match(prompt + (90, 40)) == ("long", len(prompt) + 1)  # tie: newest of short/long
    assert store.match(prompt + (50, 51)) == ("other", len(prompt) + 2)


def test_match_forgets_superseded_prompt(store):
    store.put(conv("s", SYSTEM + (1, 2, 3, 4), (90,)))
    store.put(conv("s", tuple(range(300, 312)), (91,)))
    assert store.match(SYSTEM + (1, 2, 3, 4, 90)) == (None, 0)
    assert store.match(tuple(range(300, 313))) == ("s", 12)


def test_match_by_text_after_splice(store):
    """A stored prompt spliced from generated ids differs from a plain tokenization of
    its text; the text still identifies the session."""
    spliced_prompt = SYSTEM + (1001, 1002) + (3, 4)  # 1001, 1002: ids the engine generated
    stored = Conversation(
        session_id="s",
        token_ids=spliced_prompt + (1005,),
        prompt_len=len(spliced_prompt),
        text="sys|ab|cd|e",
        handle=handle(),
    )
    store.put(stored)
    plain = SYSTEM + (97, 98) + (3, 4) + (101, 9, 9)  # re-tokenized "ab", "e"
    assert store.match(plain) == (None, 0)
    assert store.match(plain, "sys|ab|cd|e|next") == ("s", len(stored.token_ids))
    assert store.match(plain, "sys|ab|XX|e|next") == (None, 0)


def test_match_needs_a_full_block(store):
    store.put(conv("s", (1, 2, 3), (4,)))  # shorter than one index block: not indexed
    assert store.match((1, 2, 3, 4, 5, 6, 7, 8)) == (None, 0)


def test_chain_hashes_and_common_prefix():
    a = chain_hashes(list(range(10)), 4)
    assert len(a) == 2
    b = chain_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert common_prefix_len((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_len((1, 2), (1, 2, 3)) == 2
    assert common_prefix_len((), (1,)) == 0


# -- restrict ---------------------------------------------------------------------------------


def test_restrict_caps_to_common_prefix():
    held = tuple(range(20))
    h = handle(blocks=5, num_tokens=19)  # the last generated token has no KV yet
    prompt = tuple(range(13)) + (99, 98, 97)
    capped, drift = restrict(h, prompt, held, BLOCK)
    assert capped.num_tokens == 13
    # Drift counts positions the prompt could have used (up to its last token, 15) that
    # disagree with the held ones: 13 and 14.
    assert drift == 2
    # Only the 4 leading blocks that hold positions 0..12 are offered to the reader.
    assert capped.block_ids == (h.block_ids[0][:4],)


def test_restrict_never_includes_prompt_last_token():
    held = tuple(range(20))
    h = handle(num_tokens=19)
    capped, drift = restrict(h, held[:10], held, BLOCK)
    assert capped.num_tokens == 9
    assert drift == 0  # the prompt simply ends earlier: nothing drifted
    capped, drift = restrict(h, held, held, BLOCK)
    assert capped.num_tokens == 19
    assert drift == 0


def test_restrict_full_continuation():
    held = tuple(range(20))
    h = handle(num_tokens=19)
    capped, drift = restrict(h, held + (1, 2, 3), held, BLOCK)
    assert capped.num_tokens == 19
    assert drift == 0


def test_restrict_ignores_held_ids_beyond_handle():
    held = tuple(range(20))
    h = handle(num_tokens=10)
    capped, drift = restrict(h, held + (1,), held, BLOCK)
    assert capped.num_tokens == 10
    assert drift == 0


def test_restrict_total_mismatch():
    h = handle(num_tokens=19)
    capped, drift = restrict(h, (7, 7, 7, 7, 7), tuple(range(20)), BLOCK)
    assert capped.num_tokens == 0
    assert drift == 4


def test_store_rejects_ttl_not_below_decoder_ttl(clock):
    with pytest.raises(ValueError):
        make_store(clock, handle_ttl_s=DECODER_TTL)


def _exit_by(exit_state, store, clock) -> str:
    """Drive a stored handle of session "s" out by `exit_state` through the public API."""
    store.put(conv("s", range(10), blocks=3))
    if exit_state in OUTCOME_STATE.values():  # claimed, then settled by its turn
        outcome = next(o for o, state in OUTCOME_STATE.items() if state is exit_state)
        store.end_turn(store.begin_turn("s").lease_id, outcome, None)
    elif exit_state is HandleState.EXPIRED:
        clock.advance(TTL)
    elif exit_state is HandleState.EVICTED:
        store.set_engine_capacity("d-0", 2)  # a budget of 1 block
    elif exit_state is HandleState.SUPERSEDED:
        store.put(conv("s", range(12), blocks=1))
    elif exit_state is HandleState.DROPPED:
        store.drop_engine("d-0")
    elif exit_state is HandleState.ENDED:
        store.end_session("s")
    return "s"


def test_states_cover_every_exit(clock):
    """Every state but the live ones and NO_HANDLE is an exit: reachable from STORED in
    the transition table, final, produced by the store's public API, and counted."""
    reachable, frontier = set(), [HandleState.STORED]
    while frontier:
        for nxt in TRANSITIONS.get(frontier.pop(), ()):
            if nxt not in reachable:
                reachable.add(nxt)
                frontier.append(nxt)
    exits = reachable - LIVE_STATES
    assert exits == set(HandleState) - LIVE_STATES - {HandleState.NO_HANDLE}
    assert LIVE_STATES <= reachable | {HandleState.STORED} and HandleState.NO_HANDLE not in reachable
    for exit_state in exits:
        assert not TRANSITIONS.get(exit_state), exit_state  # final
        store = make_store(clock)
        session = _exit_by(exit_state, store, clock)
        stats = store.stats()
        assert store.counts[exit_state.value] == 1 and stats["counts"][exit_state.value] == 1, exit_state
        unread = exit_state not in (HandleState.PULLED, HandleState.DROPPED)
        assert [r.reason for r in store.take_releases()] == ([exit_state] if unread else []), exit_state
        kept = exit_state not in (HandleState.SUPERSEDED, HandleState.ENDED)
        if kept:  # the record stays, its handle in the exit state, and says so on a claim
            assert stats["handles"] == {exit_state.value: 1}, exit_state
            claim = store.begin_turn(session)
            assert claim.handle is None and claim.miss_reason == Miss(exit_state.value), exit_state
            assert store.counts[Miss(exit_state.value).event] == 1
        else:
            assert stats["handles"] == ({"stored": 1} if exit_state is HandleState.SUPERSEDED else {})
        # Every counter the store emitted is in its vocabulary.
        assert set(store.stats()["counts"]) <= set(StoreEvent), exit_state
    # A conversation without a handle enters NO_HANDLE, final and not listed as a handle.
    assert HandleState.NO_HANDLE in TRANSITIONS[None] and not TRANSITIONS.get(HandleState.NO_HANDLE)
    store = make_store(clock)
    store.put(conv("s", range(10), with_handle=False))
    assert store.stats()["handles"] == {} and store.begin_turn("s").miss_reason == Miss.NO_HANDLE


# -- fleet scale: bounded matching ------------------------------------------------------------

FLEET_SYSTEM = tuple(range(10_000, 10_064))  # 16 blocks shared by every conversation


def fleet(store, clock, n=1000):
    """n conversations sharing FLEET_SYSTEM: own first message (2 blocks) and answer."""
    convs = []
    for i in range(n):
        prompt = FLEET_SYSTEM + tuple(range(20_000 + 8 * i, 20_000 + 8 * i + 8))
        convs.append(conv(f"f{i}", prompt, tuple(range(50_000 + 5 * i, 50_000 + 5 * i + 5))))
        store.put(convs[-1])
        clock.advance(0.001)
    return convs


def test_fleet_new_conversation_matches_none_in_bounded_work(clock):
    store = make_store(clock, max_sessions=2000)
    fleet(store, clock)
    store.counts.clear()
    new = FLEET_SYSTEM + tuple(range(90_000, 90_040))
    assert store.match(new) == (None, 0)
    # Sessions sharing only the system prompt are not even candidates.
    assert store.counts["match_candidates"] == 0
    assert store.counts["match_compared_tokens"] == 0


def test_fleet_next_turn_matches_its_conversation_only(clock):
    store = make_store(clock, max_sessions=2000)
    convs = fleet(store, clock)
    for i in (0, 1, 499, 998, 999):
        store.counts.clear()
        c = convs[i]
        follow_up = c.token_ids + (7, 7, 7, 7, 7, 7)
        assert store.match(follow_up) == (c.session_id, len(c.token_ids))
        # One deepest key, one candidate, one verification over the prompt's length.
        assert store.counts["match_candidates"] == 1
        assert store.counts["match_compared_tokens"] <= len(follow_up) + BLOCK
        # A re-tokenized answer still finds it, by the prompt.
        retok = c.token_ids[: c.prompt_len] + (3, 3, 3, 3, 3)
        assert store.match(retok) == (c.session_id, c.prompt_len)


def test_identical_prompts_never_cross(clock):
    """Two conversations with the same prompt: each one's next turn goes to it alone,
    whether the answers differ in their first block or only in a sub-block tail."""
    store = make_store(clock)
    prompt = SYSTEM + (1, 2, 3, 4)
    store.put(conv("a", prompt, (60, 61, 62, 63, 64, 65)))
    clock.advance(1)
    store.put(conv("b", prompt, (70, 71, 72, 73, 74, 75)))
    clock.advance(1)
    store.put(conv("c", prompt, (60, 61, 62, 63, 64, 99)))  # shares a's first answer block
    assert store.match(prompt + (60, 61, 62, 63, 64, 65, 5, 5)) == ("a", len(prompt) + 6)
    assert store.match(prompt + (70, 71, 72, 73, 74, 75, 5, 5)) == ("b", len(prompt) + 6)
    assert store.match(prompt + (60, 61, 62, 63, 64, 99, 5, 5)) == ("c", len(prompt) + 6)


def test_match_fanout_bounds_identical_keys(clock):
    store = make_store(clock, match_fanout=4)
    prompt = SYSTEM + (1, 2, 3, 4)
    for i in range(50):
        store.put(conv(f"same{i}", prompt, (200 + i,)))
        clock.advance(1)
    store.counts.clear()
    # The most recent among the checked ones that agrees longest.
    assert store.match(prompt + (249, 1)) == ("same49", len(prompt) + 1)
    assert store.counts["match_candidates"] == 4
    assert store.match(prompt + (9,)) == ("same49", len(prompt))


def test_match_by_text_prefers_longest(clock):
    store = make_store(clock)
    for sid, text in (("short", "abcdefgh|x"), ("long", "abcdefgh|xyz12")):
        store.put(Conversation(sid, SYSTEM + (1, 2, 3, 4), 8, text=text, handle=handle()))
        clock.advance(1)
    assert store.match((9,) * 12, "abcdefgh|xyz123|next") == ("long", 12)
    assert store.match((9,) * 12, "abcdefgh|xy|next") == ("short", 12)
    assert store.match((9,) * 12, "abcdefgh|") == (None, 0)


# -- compact conversations and the bytes bound -------------------------------------------------


def test_conversation_is_compact_and_reads_as_tuple():
    import pickle
    from array import array

    c = conv("s", range(1000), range(5000, 5010))
    assert isinstance(c.token_ids, tuple) and c.token_ids == tuple(range(1000)) + tuple(range(5000, 5010))
    wire = pickle.loads(pickle.dumps(c))
    assert wire == c
    assert isinstance(wire.compact_ids, array) and wire.compact_ids.itemsize == 4
    assert wire.token_ids + (1,) == c.token_ids + (1,)
    with pytest.raises(AttributeError):
        c.prompt_len = 3
    # Ids travel as 4-byte ints, not as a pickled tuple.
    assert len(pickle.dumps(c)) < 4 * 1010 + 1000


def test_store_keeps_compact_ids_and_counts_bytes(store):
    from array import array

    store.put(conv("a", range(1000), range(10)))
    store.put(conv("b", range(2000), range(10)))
    stats = store.stats()
    assert stats["bytes"] >= 4 * (1010 + 2010)
    assert stats["bytes"] < 4 * (1010 + 2010) + 2 * 2000  # ~4 bytes a token plus a small overhead
    assert stats["bytes_per_session"] == stats["bytes"] // 2
    claim = store.begin_turn("a")
    assert isinstance(claim.conversation.compact_ids, array)
    assert claim.conversation.token_ids == tuple(range(1000)) + tuple(range(10))


def test_bytes_bound_evicts_least_recently_used(clock):
    store = make_store(clock, max_store_bytes=3 * (4 * 1000 + 1000))
    for sid in "abc":
        store.put(conv(sid, range(1000)))
        clock.advance(1)
    store.begin_turn("a")  # a is now recent: b goes first
    store.put(conv("d", range(1000)))
    assert store.counts["evicted_for_bytes"] >= 1
    assert store.begin_turn("b").miss_reason == "no_conversation"
    assert store.begin_turn("d").handle is not None
    assert store.stats()["bytes"] <= 3 * (4 * 1000 + 1000)


# -- decode-memory hooks ---------------------------------------------------------------------------


def releases(store):
    return [(r.engine_id, r.num_blocks, r.reason.value) for r in store.take_releases()]


def test_every_unread_exit_is_released_once(clock):
    store = make_store(clock, max_sessions=4)
    store.put(conv("sup", range(10), blocks=1))
    store.put(conv("sup", range(12), blocks=2))  # superseded: 1
    assert releases(store) == [("d-0", 1, "superseded")]
    for outcome, blocks in ((TurnOutcome.UNUSED, 3), (TurnOutcome.FAILED, 4), (TurnOutcome.PULLED, 5)):
        store.put(conv(outcome.value, range(10), blocks=blocks))
        store.end_turn(store.begin_turn(outcome.value).lease_id, outcome, None)
    assert releases(store) == [("d-0", 3, "unused"), ("d-0", 4, "failed")]  # pulled: read, not released
    store.put(conv("x", range(10), blocks=6))  # 5 sessions > 4: the oldest goes
    assert releases(store) == [("d-0", 2, "evicted")]
    assert store.end_session("x") and releases(store) == [("d-0", 6, "ended")]
    store.put(conv("exp", range(10), blocks=7))
    clock.advance(TTL)
    assert releases(store) == [("d-0", 7, "expired")]
    store.put(conv("lease", range(10), blocks=8))
    store.begin_turn("lease")
    clock.advance(50.0)
    assert releases(store) == [("d-0", 8, "expired")]
    assert store.counts["lease_expired"] == 1
    store.put(conv("drop", range(10), blocks=9, engine="d-9"))
    store.drop_engine("d-9")
    assert releases(store) == []  # the engine is gone: nothing to free
    assert store.stats()["pending_releases"] == 0


def test_taken_releases_stop_counting_untaken_expire_with_decoder_ttl(store, clock):
    store.put(conv("s", range(10), blocks=2))
    store.put(conv("s", range(12), blocks=5))
    assert store.pinned_blocks("d-0") == 7
    assert releases(store) == [("d-0", 2, "superseded")]
    assert store.pinned_blocks("d-0") == 5
    store.put(conv("s", range(14), blocks=3))  # 5 superseded, never taken
    assert store.stats()["pending_releases"] == 1 and store.pinned_blocks("d-0") == 8
    clock.advance(DECODER_TTL)  # the engine freed them itself; s's handle expired meanwhile
    assert store.stats()["pending_releases"] == 0
    assert store.pinned_blocks("d-0") == 0
    assert store.take_releases() == []


def test_engine_capacity_sets_the_pin_budget(clock):
    store = make_store(clock, max_blocks_per_engine=1000, pinned_fraction=0.5)
    for sid in "abcd":
        store.put(conv(sid, range(10), blocks=10))
        clock.advance(1)
    store.put(conv("other", range(10), blocks=30, engine="d-1"))
    store.set_engine_capacity("d-0", 51)  # floor(25.5) = 25: a and b go, oldest first
    assert store.stats()["pin_budgets"] == {"d-0": 25}
    assert store.counts["evicted_for_blocks"] == 2
    assert [r.request_id for r in store.take_releases()] == [
        store.begin_turn("a").conversation.handle.request_id,
        store.begin_turn("b").conversation.handle.request_id,
    ]
    assert store.pinned_blocks("d-0") == 20
    # Claimed handles count against the budget but are never evicted.
    store.begin_turn("c")
    store.put(conv("e", range(10), blocks=10))
    assert store.begin_turn("d").miss_reason == "evicted"
    assert store.pinned_blocks("d-0") == 20 + 10  # d's release not taken yet
    # Another engine keeps the default bound.
    assert store.begin_turn("other").handle is not None


def test_claim_exposes_pin_remaining(store, clock):
    store.put(conv("s", range(10)))
    clock.advance(30)
    claim = store.begin_turn("s")
    assert claim.pin_remaining_s == pytest.approx(DECODER_TTL - 30)
    assert store.begin_turn("s").pin_remaining_s is None


def test_end_session_with_a_turn_in_flight(store):
    store.put(conv("s", range(10), blocks=2))
    claim = store.begin_turn("s")
    assert store.end_session("s") is True
    assert store.stats()["sessions"] == 0
    nxt = conv("s", range(14), blocks=4)
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, nxt)
    # The claim settles; the new turn is not stored, its blocks are released.
    assert store.counts["pulled"] == 1
    assert store.begin_turn("s").miss_reason == "no_conversation"
    assert releases(store) == [("d-0", 4, "ended")]
    assert store.end_session("nobody") is False


def test_late_end_turn_releases_the_new_turn(store, clock):
    store.put(conv("s", range(10), blocks=2))
    claim = store.begin_turn("s")
    clock.advance(50.0)
    store.stats()
    store.take_releases()
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, conv("s", range(14), blocks=4))
    assert store.counts["late_end_turn"] == 1
    assert releases(store) == [("d-0", 4, "expired")]


def test_bookkeeping_does_not_walk_every_session(clock, monkeypatch):
    """Per-turn calls touch only what they change: with 2,000 sessions stored, a turn
    reads no other record (records are only reached through the LRU map's ends)."""
    store = make_store(clock, max_sessions=5000)
    for i in range(2000):
        store.put(conv(f"s{i}", range(10)))
    reads = []

    class Watched(OrderedDict):
        def __iter__(self):
            reads.append("iter")
            return super().__iter__()

        def values(self):
            reads.append("values")
            return super().values()

        def items(self):
            reads.append("items")
            return super().items()

    store._records = Watched(store._records)
    reads.clear()
    claim = store.begin_turn("s5")
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, conv("s5", range(12)))
    store.pinned_blocks("d-0")
    assert len(reads) <= 2  # at most a peek at the LRU head


def test_a_conversation_the_caller_holds_is_not_sent_back(store):
    c1 = conv("s", range(1, 100), (7, 8))
    store.put(c1)
    claim = store.begin_turn("s", known=c1.handle.request_id)
    assert claim.conversation_known and claim.conversation is None
    assert claim.handle == c1.handle  # the handle is claimed all the same
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, None)
    # Another caller stored a newer turn: the id no longer matches, the turn comes back.
    c2 = conv("s", range(1, 120), (9,))
    store.put(c2)
    claim = store.begin_turn("s", known=c1.handle.request_id)
    assert not claim.conversation_known and claim.conversation.token_ids == c2.token_ids


def test_a_turn_sent_as_its_tail_is_stored_whole_and_indexed(store):
    c1 = Conversation("s", tuple(range(1, 40)), 30, "t" * 39, handle(num_tokens=38), "decode#0")
    store.put(c1)
    claim = store.begin_turn("s")
    nxt = Conversation(
        "s", c1.token_ids + (50, 51, 52, 60, 61), 42, c1.text + "uvwxy", handle(num_tokens=43), "decode#1"
    )
    tail = ConversationTail.of(nxt, claim.conversation)
    assert (
        tail is not None
        and tuple(tail.ids) == (50, 51, 52, 60, 61)
        and tail.text == "uvwxy"
        and tail.base_tokens == 39
    )
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, tail)
    claim = store.begin_turn("s")
    assert claim.conversation == nxt  # ids, text, prompt length, handle, replica
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    # Indexed like a whole conversation: the next prompt matches it, by ids and by text.
    assert store.match(nxt.token_ids + (70,)) == ("s", 44)
    assert store.match([9] * 50, nxt.text + "z")[0] == "s"
    assert store.counts["tail_mismatch"] == 0


def test_a_turn_that_does_not_extend_its_claim_has_no_tail():
    base = Conversation("s", (1, 2, 3, 4), 3, "abcd")
    assert ConversationTail.of(Conversation("s", (1, 2, 9, 4, 5), 4, "abcde"), base) is None  # ids differ
    assert ConversationTail.of(Conversation("s", (1, 2, 3, 4, 5), 4, "abXde"), base) is None  # text differs
    assert ConversationTail.of(Conversation("s", (1, 2, 3, 4, 5), 4, None), base) is None  # text lost
    assert ConversationTail.of(Conversation("s", (1, 2, 3), 2, "abc"), base) is None  # shorter
    assert ConversationTail.of(Conversation("t", (1, 2, 3, 4, 5), 4, "abcde"), base) is None  # other session
    same = ConversationTail.of(Conversation("s", (1, 2, 3, 4), 3, "abcd"), base)
    assert same is not None and len(same.ids) == 0 and same.text == ""


def test_a_tail_that_does_not_fit_the_claim_is_dropped_and_its_handle_released(store):
    c1 = conv("s", range(1, 20), (7, 8))
    store.put(c1)
    claim = store.begin_turn("s")
    stray = ConversationTail("s", 5, array("i", [1, 2]), None, 6, handle(engine="d-1"), "decode#1")
    store.end_turn(claim.lease_id, TurnOutcome.PULLED, stray)
    assert store.counts["tail_mismatch"] == 1
    released = store.take_releases()
    assert [r.request_id for r in released] == [stray.handle.request_id]
    assert released[0].reason is HandleState.DROPPED
    # Nothing of it was stored: the session still holds its previous conversation.
    assert store.begin_turn("s").conversation.token_ids == c1.token_ids
