"""Which decode engine holds which conversation's KV: the handle store's lifecycle.

Pure Python, no Ray: `connector.actor` runs `HandleStore` inside Ray actors shared by
every ingress replica, and unit tests drive it directly with a fake clock. The value
types it takes and hands out are in `connector.records`, the sessionless match index in
`connector.match`, the pinned-block ledger in `connector.pins`, tenant shares in
`connector.shares`, and its counter and miss-reason vocabularies in `connector.events`;
the names callers import from here are re-exported (`__all__`). The records it keeps and
every change to them (state transitions, exits, bounds, expiry) are its base,
`connector.store_book.StoreBook`; the operations here decide and call in there.

A session keeps one `Conversation`: the exact token sequence its decode engine holds
(prompt + generated ids), the rendered text those ids stand for, and a `KVHandle` to the
pinned blocks. A handle lives through

    STORED --claim--> CLAIMED --end_turn--> PULLED | UNUSED | FAILED
       |                  `-- lease timeout --> EXPIRED
       |-- expiry --> EXPIRED        (our TTL, shorter than the decode engine's pin time)
       |-- bounds --> EVICTED        (LRU by sessions, bytes, or pinned blocks per engine)
       |-- next turn stored --> SUPERSEDED
       |-- its decode replica died --> DROPPED
       `-- the client ended the session --> ENDED

and every exit is counted. A conversation stored without a handle is NO_HANDLE for
good (not listed in `stats()["handles"]`). Every handle that leaves unread (all exits
but PULLED and DROPPED) becomes a `Release` in the store's outbox: `take_releases` hands
them to the caller, which asks the decode engine to free those blocks now. Until then (or
until the decode engine's own TTL, `decoder_kv_blocks_ttl`) the store counts them as
pinned.

Scale: every per-turn operation is O(1) or O(log n) in live sessions (expiry and leases
in deadline order, pinned blocks counted incrementally), a sessionless `match` costs one
walk of the prompt plus a bounded number of candidate checks, and a conversation costs
about 4 bytes per token (ids kept as `array('i')`) plus its text.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from connector.events import Miss, StoreEvent, TenantEvent
from connector.handle import KVHandle
from connector.match import MATCH_FANOUT
from connector.records import (
    DEFAULT_MAX_STORE_BYTES,
    OUTCOME_STATE,
    Claim,
    Conversation,
    ConversationTail,
    HandleState,
    Record,
    Release,
    TurnOutcome,
    chain_hashes,
    common_prefix_len,
    restrict,
)
from connector.shares import tenant_of
from connector.store_book import StoreBook

__all__ = [
    "DEFAULT_MAX_STORE_BYTES",
    "MATCH_FANOUT",
    "Claim",
    "Conversation",
    "ConversationTail",
    "HandleState",
    "HandleStore",
    "Release",
    "TurnOutcome",
    "chain_hashes",
    "common_prefix_len",
    "restrict",
]

_MISS: dict[HandleState | None, Miss] = {
    state: Miss(state.value)
    for state in HandleState
    if state not in (HandleState.STORED, HandleState.SUPERSEDED, HandleState.ENDED)
}
"""Why a kept record's handle cannot be claimed, by its state (SUPERSEDED and ENDED
records are no longer kept)."""


class HandleStore(StoreBook):
    """Bounded, expiring map of session -> latest conversation and its KV handle: the
    operations `connector.store_api.StoreOp` names on a shard's handle store.

    Called from one thread at a time (the actor serialises calls). Nothing blocks.
    """

    # -- turns ---------------------------------------------------------------------

    def match(self, prompt_ids: Sequence[int], prompt_text: str | None = None) -> tuple[str | None, int]:
        """The stored session this sessionless prompt continues, and how many of its
        tokens agree.

        A stored turn matches when its whole prompt is a prefix of `prompt_ids`, or when
        the text it stands for (prompt + answer) is a prefix of `prompt_text`: the latter
        still matches after token-in/token-out made the stored ids differ from a plain
        tokenization. The prompt's block-hash chain (and its text's) is walked once,
        deepest first, against an index holding each conversation under the chain hash
        where its prompt ends and where its tokens end; at the deepest hit, the most
        recent `match_fanout` candidates are checked past the hashed blocks and the best
        (longest agreement, then most recent) is verified token by token. Conversations
        that share only a system prompt are never candidates. Work (`counts`:
        `match_candidates`, `match_compared_tokens`) is bounded by the prompt.
        """
        self._sweep()
        return self._index.match(prompt_ids, prompt_text, self._records)

    def begin_turn(self, session_id: str, known: str | None = None) -> Claim:
        """Claim the session's handle for one turn. Returns a lease to end, except when
        the turn is refused (`Claim.retry_after_s`: a new session past its tenant's limit
        of live sessions; nothing was opened or claimed).

        `known`: the request id of the handle of the conversation the caller already holds
        (the turn it stored last); if that is the stored one, it is not sent back."""
        self._sweep()
        now = self._clock()
        record = self._records.get(session_id)
        handle, reason, remaining = None, None, None
        tenant = tenant_of(session_id)
        if record is None:
            wait = self._shares.refusal(tenant, session_id, now, self._ttl)
            if wait is not None:
                # The tenant has its maximum of live sessions: no lease, nothing claimed.
                self.counts[StoreEvent.SESSIONS_REFUSED] += 1
                self.tenant_counts[(tenant, TenantEvent.SESSIONS_REFUSED)] += 1
                return Claim(0, session_id, None, None, retry_after_s=wait)
            reason = Miss.NO_CONVERSATION
            self._shares.touch(tenant, session_id, now)
        else:
            self._records.move_to_end(session_id)
            self._shares.touch(tenant, session_id, now)
            if record.state is HandleState.STORED:
                handle = record.handle
                self._transition(record, HandleState.CLAIMED)
                remaining = record.stored_at + self._decoder_ttl - now
                self._claimed += 1
                self.counts[StoreEvent.CLAIMED] += 1
            elif self._leases.moving(session_id, record.handle):
                reason = Miss.MOVING
            else:
                reason = _MISS[record.state]
        if reason is not None:
            self.counts[reason.event] += 1
        lease_id = self._leases.open(
            session_id,
            handle,
            record.decode_replica if record else None,
            record.stored_at if record is not None else now,
            now,
            (record.tokens, record.text) if record is not None else None,
        )
        held = record.handle if record is not None else None
        same = known is not None and held is not None and held.request_id == known
        return Claim(
            lease_id=lease_id,
            session_id=session_id,
            conversation=record.conversation() if record and not same else None,
            handle=handle,
            miss_reason=reason.value if reason is not None else None,
            pin_remaining_s=remaining,
            conversation_known=same,
        )

    def end_turn(
        self,
        lease_id: int,
        outcome: TurnOutcome,
        conversation: Conversation | ConversationTail | None,
        engine_blocks: int | None = None,
        retain: bool = False,
    ) -> None:
        """Settle a lease: record what became of the claimed handle, store the new turn.

        `engine_blocks`: the block count of the decode engine the new turn's handle pins
        on, when the caller knows it. A store that has no budget for that engine (it was
        restarted empty, or never told) takes it, as `set_engine_capacity` would.
        `retain`: the client asked for long retention (see `put`).

        Called exactly once per `begin_turn`, on every path (the ingress uses `finally`).
        A late call (lease expired) or one for a session ended meanwhile stores nothing;
        the new turn's handle is then released. The new turn may come as a
        `ConversationTail` over the conversation the claim handed out; one that does not
        fit it is not stored (`tail_mismatch`) and its handle is released.
        """
        now = self._clock()
        lease = self._leases.pop(lease_id)
        if lease is None:
            self.counts[StoreEvent.LATE_END_TURN] += 1
            self._release_new(conversation, HandleState.EXPIRED, now)
            return
        if lease.handle is not None:
            if outcome is TurnOutcome.KEPT:
                self._give_back(lease, now)
            else:
                self._settle(lease, OUTCOME_STATE[outcome], now)
        if lease.ended:
            self._release_new(conversation, HandleState.ENDED, now)
            return
        base = None
        if isinstance(conversation, ConversationTail):
            tail = conversation
            conversation = tail.over(*lease.base) if lease.base is not None else None
            if conversation is None:
                self.counts[StoreEvent.TAIL_MISMATCH] += 1
                self._release_new(tail, HandleState.DROPPED, now)
                return
            base = lease.base
        if conversation is not None:
            new = conversation.handle
            if engine_blocks and new is not None and not self._pins.knows(new.engine_id):
                self._pins.set_capacity(new.engine_id, engine_blocks)
            self.put(conversation, base, retain)

    def put(
        self,
        conversation: Conversation,
        base: tuple[array, str | None] | None = None,
        retain: bool = False,
        stored_at: float | None = None,
    ) -> None:
        """Store a session's latest turn, superseding the previous one. `base`: ids and
        text the turn is known to start with (a resolved `ConversationTail`). `retain`:
        when its engine is over budget, its handle goes after the tenant's others
        (`TenantShares.victim`); the budget still wins. Each turn sets it anew.
        `stored_at`: when the conversation was stored, if earlier than now (a move): its
        expiry counts from then."""
        self._sweep()
        now = self._clock()
        session_id = conversation.session_id
        old = self._records.get(session_id)
        if old is not None:
            if old.state is HandleState.STORED:
                self._leave(old, HandleState.SUPERSEDED)
            self._remove(old)
        since = now if stored_at is None else min(stored_at, now)
        record = Record(conversation, since, since + self._ttl, retain)
        self._index.keys(record, old, base)
        self._records[session_id] = record
        self._shares.touch(tenant_of(session_id), session_id, now)
        self._bytes += record.nbytes
        self._index.add(record)
        if record.handle is None:
            self._transition(record, HandleState.NO_HANDLE)
        else:
            self._transition(record, HandleState.STORED)
            if since < now:
                self._refile_expiry(record)
            self.counts[StoreEvent.STORED] += 1
            self._enforce_budget(record.handle.engine_id)
        while self._records and (len(self._records) > self._max_sessions or self._bytes > self._max_bytes):
            if len(self._records) <= self._max_sessions:
                self.counts[StoreEvent.EVICTED_FOR_BYTES] += 1
            self._evict(next(iter(self._records.values())))
            self.counts[StoreEvent.SESSIONS_EVICTED] += 1

    def end_session(self, session_id: str) -> bool:
        """Forget a session now (the client ended it). Its stored handle is released
        (reason ENDED); a turn of it still in flight settles its claim, but its new turn
        is released rather than stored. Returns False if the store kept no such session."""
        self._sweep()
        record = self._records.get(session_id)
        if not self._leases.end_session(session_id) and record is None:
            return False
        if record is not None:
            if record.state is HandleState.STORED:
                self._leave(record, HandleState.ENDED)
            self._remove(record)
        self.counts[StoreEvent.SESSIONS_ENDED] += 1
        return True

    def drop_engine(self, engine_id: str) -> int:
        """Forget every stored handle on `engine_id` (its replica is gone). Returns how many."""
        self._sweep()
        stored = self._stored_on.get(engine_id, {})
        dropped = 0
        for session_id in list(stored):
            self._leave(self._records[session_id], HandleState.DROPPED)
            dropped += 1
        self._pins.forget_engine(engine_id)
        return dropped

    # -- moves: a stopping decode replica hands its conversations to a peer ------------

    def moving_out(self, engine_id: str) -> list[tuple[float, str]]:
        """The sessions whose stored handle pins blocks on `engine_id`, as
        `(stored_at, session_id)`, most recently stored first: the order a drain moves them."""
        self._sweep()
        stored = self._stored_on.get(engine_id, {})
        return [(self._records[s].stored_at, s) for s in reversed(stored)]

    def begin_move(self, session_id: str, engine_id: str) -> Claim | None:
        """Claim the session's handle for a move to another decode engine, if it is still
        stored on `engine_id` (None otherwise: a turn claimed it, or it left). Until
        `end_move`, a turn of the session finds it `moving` and may wait for the move."""
        self._sweep()
        record = self._records.get(session_id)
        if record is None or record.state is not HandleState.STORED:
            return None
        handle = record.handle
        assert handle is not None  # STORED holds one
        if handle.engine_id != engine_id:
            return None
        now = self._clock()
        self._transition(record, HandleState.CLAIMED)
        self._claimed += 1
        self.counts[StoreEvent.MOVES_STARTED] += 1
        lease_id = self._leases.open(
            session_id,
            handle,
            record.decode_replica,
            record.stored_at,
            now,
            (record.tokens, record.text),
            move=True,
        )
        return Claim(
            lease_id=lease_id,
            session_id=session_id,
            conversation=record.conversation(),
            handle=handle,
            pin_remaining_s=record.stored_at + self._decoder_ttl - now,
        )

    def end_move(self, lease_id: int, handle: KVHandle | None, decode_replica: str | None) -> str:
        """Settle a move: `handle` pins the conversation's blocks on the peer
        (`decode_replica`) now, or None if the move failed. Returns `moved`, `failed`,
        `superseded` (a turn stored a newer conversation, or ended the session,
        meanwhile: the peer's copy is released) or `late` (the lease had expired).

        The swap is atomic: the record goes from the old handle (claimed, so no turn could
        read it meanwhile) to the new one, kept with its ids, text and retention."""
        now = self._clock()
        lease = self._leases.pop(lease_id)
        if lease is None:
            self._release_unread(handle, decode_replica, HandleState.EXPIRED, now)
            return "late"
        record = self._records.get(lease.session_id)
        current = record is not None and record.handle is lease.handle and record.state is HandleState.CLAIMED
        # The old blocks were read by the peer (its engine frees them) or go with the replica.
        self._settle(lease, HandleState.PULLED if handle is not None else HandleState.FAILED, now)
        if handle is None:
            self.counts[StoreEvent.MOVE_FAILED] += 1
            return "failed"
        if not current or lease.ended:
            self.counts[StoreEvent.MOVE_SUPERSEDED] += 1
            self._release_unread(handle, decode_replica, HandleState.SUPERSEDED, now)
            return "superseded"
        assert record is not None  # `current`
        moved = Conversation(
            record.session_id, record.tokens, record.prompt_len, record.text, handle, decode_replica
        )
        self.counts[StoreEvent.MOVED] += 1
        self.counts[StoreEvent.MOVED_BLOCKS] += handle.num_blocks
        # The move keeps the conversation's age: its handle expires when it would have
        # unmoved (a move is not a turn), and the peer's pin is then released early.
        self.put(moved, (record.tokens, record.text), record.retained, stored_at=record.stored_at)
        return "moved"

    # -- decode memory -----------------------------------------------------------------

    def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        """The decode engine has `total_blocks` KV blocks: from now on its waiting
        conversations may pin `floor(pinned_fraction * total_blocks)` of them (until
        then, `max_blocks_per_engine`). Evicts least recently stored handles past it."""
        self._sweep()
        self._pins.set_capacity(engine_id, total_blocks)
        self._enforce_budget(engine_id)

    def take_releases(self) -> list[Release]:
        """Handles that left unread since the last call, oldest first. The caller owns
        them: it asks each decode engine to free those blocks now, and the store stops
        counting them as pinned. Releases nobody takes are dropped when the decode
        engine's TTL would have freed the blocks anyway."""
        self._sweep()
        releases = self._pins.take()
        self.counts[StoreEvent.RELEASES_TAKEN] += len(releases)
        return releases

    # -- introspection ---------------------------------------------------------------

    def pinned_blocks(self, engine_id: str) -> int:
        """Blocks we believe `engine_id` keeps pinned for us: stored, claimed, and left
        unread (until their release is taken or the decode engine's TTL passed)."""
        self._sweep()
        return self._pins.pinned(engine_id)

    def stats(self) -> dict:
        """Figures for metrics and operators; counter keys as plain strings."""
        self._sweep()
        sessions = len(self._records)
        handles = {s.value: n for s, n in self._states.items() if n and s is not HandleState.NO_HANDLE}
        return {
            "sessions": sessions,
            "handles": handles,
            "open_leases": len(self._leases),
            "claimed_handles": self._claimed,
            "pinned_blocks": {e: self._pins.pinned(e) for e in sorted(self._pins.engines())},
            "pin_budgets": dict(self._pins.budgets),
            "pending_releases": self._pins.pending,
            "bytes": self._bytes,
            "bytes_per_session": self._bytes // sessions if sessions else 0,
            "counts": {str(event): n for event, n in self.counts.items()},
            "tenants": self._tenant_stats(),
        }

    def _tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant namespace (a hash of its key, never the key): sessions kept, blocks
        pinned, evictions."""
        out = self._shares.stats()
        for (tenant, event), n in self.tenant_counts.items():
            out.setdefault(tenant, {"sessions": 0, "pinned_blocks": 0})[event.value] = n
        return out
