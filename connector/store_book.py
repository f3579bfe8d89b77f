"""The handle store's books: the kept records and every change to them.

`connector.store.HandleStore` is a `StoreBook`: its operations (turns, moves, decode
memory) decide what happens to a conversation and call in here to make it so. This is
the one place a record's state changes (`_transition`, checked against
`connector.records.TRANSITIONS`), a handle's exit is counted and its blocks handed to the
pin ledger (`connector.pins`, whose releases the caller frees on the decode engine),
tenant shares move (`connector.shares`), and the store's bounds evict. Pure Python, one
thread at a time (the shard actor serialises calls); nothing blocks.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping

from connector.events import StoreEvent, TenantEvent
from connector.handle import KVHandle
from connector.leases import Lease, LeaseBook
from connector.match import MATCH_FANOUT, MatchIndex
from connector.pins import PinLedger
from connector.records import (
    DEFAULT_MAX_STORE_BYTES,
    LIVE_STATES,
    TRANSITIONS,
    Conversation,
    ConversationTail,
    HandleState,
    Record,
)
from connector.shares import TenantShares, tenant_of

_NOT_EXITS = LIVE_STATES | {HandleState.NO_HANDLE}
_EXIT_EVENT = {state: StoreEvent(state.value) for state in HandleState if state not in _NOT_EXITS}
"""The counter of each exit, by the state the handle left in."""


class StoreBook:
    """Bounded, expiring map of session -> latest conversation and its KV handle, and
    the ledgers that follow it. Expiry and lease deadlines are kept in insertion order,
    which is deadline order because their TTLs are uniform and `clock` is monotonic."""

    def __init__(
        self,
        *,
        handle_ttl_s: float,
        decoder_ttl_s: float,
        max_sessions: int,
        max_blocks_per_engine: int,
        index_block_size: int = 32,
        lease_timeout_s: float = 600.0,
        pinned_fraction: float = 0.5,
        max_store_bytes: int = DEFAULT_MAX_STORE_BYTES,
        text_block_chars: int = 64,
        match_fanout: int = MATCH_FANOUT,
        tenant_weights: Mapping[str, float] | None = None,
        tenant_max_sessions: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if handle_ttl_s >= decoder_ttl_s:
            raise ValueError("handle_ttl_s must be shorter than the decode engine's pin time")
        if not 0 < pinned_fraction <= 1:
            raise ValueError("pinned_fraction must be in (0, 1]")
        self._ttl = handle_ttl_s
        self._decoder_ttl = decoder_ttl_s
        self._max_sessions = max_sessions
        self._max_bytes = max_store_bytes
        self._clock = clock
        self.counts: Counter[str] = Counter()
        """Events by `StoreEvent` (read by plain string too)."""
        self.tenant_counts: Counter[tuple[str, TenantEvent]] = Counter()
        """(tenant namespace, event): evictions for blocks and for the tenant's session limit."""
        self._records: OrderedDict[str, Record] = OrderedDict()  # LRU order
        self._bytes = 0
        self._expiring: OrderedDict[str, Record] = OrderedDict()  # STORED handles, by expiry
        self._stored_on: dict[str, dict[str, None]] = {}  # engine -> STORED sessions, oldest first
        self._index = MatchIndex(self.counts, index_block_size, text_block_chars, match_fanout)
        self._leases = LeaseBook(lease_timeout_s)
        self._claimed = 0
        self._states: Counter[HandleState] = Counter()  # states of kept records (`_recount`)
        self._pins = PinLedger(decoder_ttl_s, max_blocks_per_engine, pinned_fraction)
        self._shares = TenantShares(tenant_weights, tenant_max_sessions)
        """Per tenant (`connector.shares`): shares of each engine's budget, kept sessions."""

    # -- internals -----------------------------------------------------------------

    def _transition(self, record: Record, state: HandleState) -> None:
        """The one place a record's state changes, checked against `TRANSITIONS` (a new
        record enters from None): entering and leaving STORED file and unfile the handle
        (expiry order, per-engine order, tenant shares, pinned blocks)."""
        if state not in TRANSITIONS.get(record.state, ()):
            before = record.state.value if record.state is not None else "new"
            raise AssertionError(f"handle of {record.session_id}: {before} -> {state.value}")
        if HandleState.STORED in (record.state, state):
            handle, session_id = record.handle, record.session_id
            assert handle is not None  # a STORED record holds one
            engine, tenant = handle.engine_id, tenant_of(session_id)
            if record.state is HandleState.STORED:
                self._expiring.pop(session_id, None)
                stored = self._stored_on[engine]
                del stored[session_id]
                if not stored:
                    del self._stored_on[engine]
                self._shares.unstored(engine, tenant, session_id, record.retained)
            else:
                self._pins.hold(handle)
                self._shares.hold(engine, tenant, handle.num_blocks)
                self._stored_on.setdefault(engine, {})[session_id] = None
                self._shares.stored(engine, tenant, session_id, record.retained)
                self._expiring[session_id] = record
        self._recount(record.state, state)
        record.state = state

    def _recount(self, before: HandleState | None, after: HandleState | None) -> None:
        """The one place `_states` changes: a kept record leaves `before` for `after`
        (None: it is entering, or leaving, the map)."""
        if before is not None:
            self._states[before] -= 1
        if after is not None:
            self._states[after] += 1

    def _leave(self, record: Record, state: HandleState) -> None:
        """A STORED handle leaves without being claimed."""
        handle = record.handle
        assert handle is not None  # STORED holds one
        self._transition(record, state)
        self.counts[_EXIT_EVENT[state]] += 1
        self._pins.let_go(handle, state, record.stored_at, record.decode_replica, self._clock())
        self._shares.let_go(handle.engine_id, tenant_of(record.session_id), handle.num_blocks)

    def _settle(self, lease: Lease, state: HandleState, now: float) -> None:
        """A claimed handle's lease ends: read, unused, failed (counted by state), or
        timed out (counted as `lease_expired`)."""
        handle = lease.handle
        assert handle is not None  # only a lease that claimed a handle settles one
        self._claimed -= 1
        if state is not HandleState.EXPIRED:
            self.counts[_EXIT_EVENT[state]] += 1
        self._pins.let_go(handle, state, lease.stored_at, lease.decode_replica, now)
        self._shares.let_go(handle.engine_id, tenant_of(lease.session_id), handle.num_blocks)
        record = self._records.get(lease.session_id)
        if record is not None and record.handle is handle and record.state is HandleState.CLAIMED:
            self._transition(record, state)

    def _give_back(self, lease: Lease, now: float) -> None:
        """A claimed handle the turn did not read goes back to STORED as it was (same
        stored time, same expiry), for its session's next turn; settled UNUSED instead if
        it expired or was replaced meanwhile."""
        handle = lease.handle
        assert handle is not None
        record = self._records.get(lease.session_id)
        if (
            record is None
            or record.handle is not handle
            or record.state is not HandleState.CLAIMED
            or record.expires_at <= now
        ):
            self._settle(lease, HandleState.UNUSED, now)
            return
        self._claimed -= 1
        self.counts[StoreEvent.GIVEN_BACK] += 1
        # Entering STORED holds its blocks and share again: let go of the claim's first.
        self._pins.unhold(handle)
        self._shares.let_go(handle.engine_id, tenant_of(lease.session_id), handle.num_blocks)
        self._transition(record, HandleState.STORED)
        self._refile_expiry(record)

    def _refile_expiry(self, record: Record) -> None:
        """Keep `_expiring` in expiry order after `record` re-entered it at the end: the
        records filed after it that expire later move behind it (few: those stored since)."""
        later = []
        for session_id in reversed(self._expiring):
            other = self._expiring[session_id]
            if other is record:
                continue
            if other.expires_at <= record.expires_at:
                break
            later.append(session_id)
        for session_id in reversed(later):
            self._expiring[session_id] = self._expiring.pop(session_id)

    def _release_new(
        self, conversation: Conversation | ConversationTail | None, reason: HandleState, now: float
    ) -> None:
        if conversation is not None:
            self._release_unread(conversation.handle, conversation.decode_replica, reason, now)

    def _release_unread(
        self, handle: KVHandle | None, decode_replica: str | None, reason: HandleState, now: float
    ) -> None:
        """Blocks of a handle that never entered the store (a new turn or a move's copy
        that was not kept): released at once."""
        if handle is not None:
            self._pins.unread_handle(handle, reason, now, decode_replica, now)

    def _evict(self, record: Record) -> None:
        """Forget a kept session for the store's bounds (its stored handle is EVICTED)."""
        if record.state is HandleState.STORED:
            self._leave(record, HandleState.EVICTED)
        self._remove(record)

    def _remove(self, record: Record) -> None:
        """Take a record out of the map, the match index and the bytes count."""
        session_id = record.session_id
        del self._records[session_id]
        self._shares.forget(tenant_of(session_id), session_id)
        self._bytes -= record.nbytes
        self._recount(record.state, None)
        self._index.remove(record)

    def _enforce_budget(self, engine_id: str) -> None:
        # The budget bounds blocks of waiting handles (stored or claimed); evicting stored
        # ones lowers it, the oldest not retained of the tenant most over its share first
        # (`TenantShares.victim`). Unread blocks are being released.
        budget = self._pins.budget(engine_id)
        while (
            self._pins.waiting[engine_id] > budget
            and (session_id := self._shares.victim(engine_id)) is not None
        ):
            record = self._records[session_id]
            self._leave(record, HandleState.EVICTED)
            self.counts[StoreEvent.EVICTED_FOR_BLOCKS] += 1
            if record.retained:
                self.counts[StoreEvent.EVICTED_RETAINED] += 1
            self.tenant_counts[(tenant_of(session_id), TenantEvent.EVICTED_FOR_BLOCKS)] += 1

    def _sweep(self) -> None:
        now = self._clock()
        while self._expiring:
            record = next(iter(self._expiring.values()))
            if record.expires_at > now:
                break
            self._leave(record, HandleState.EXPIRED)
        for lease in self._leases.expired(now):
            self.counts[StoreEvent.LEASE_EXPIRED] += 1
            if lease.handle is not None:
                self._settle(lease, HandleState.EXPIRED, now)
        self._pins.sweep(now)
