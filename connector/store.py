"""Which decode engine holds which conversation's KV: the handle store's logic.

Pure Python, no Ray: `connector.actor` runs it inside Ray actors shared by every ingress
replica, and unit tests drive it directly with a fake clock.

A session keeps one `Conversation`: the exact token sequence its decode engine holds
(prompt + generated ids), the rendered text those ids stand for, and a `KVHandle` to the
pinned blocks. A handle lives through

    STORED --claim--> CLAIMED --end_turn--> PULLED | UNUSED | FAILED
       |-- expiry --> EXPIRED        (our TTL, shorter than the decode engine's pin time)
       |-- bounds --> EVICTED        (LRU by session count, or by blocks pinned per engine)
       |-- next turn stored --> SUPERSEDED
       `-- its decode replica died --> DROPPED

and every exit is counted. Blocks of a handle that left without being read stay pinned on
the decode engine until its own TTL (`decoder_kv_blocks_ttl`); the store keeps counting
them against that engine until then.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from connector.handle import KVHandle


class HandleState(str, enum.Enum):
    STORED = "stored"
    CLAIMED = "claimed"
    PULLED = "pulled"
    UNUSED = "unused"
    FAILED = "failed"
    EXPIRED = "expired"
    EVICTED = "evicted"
    SUPERSEDED = "superseded"
    DROPPED = "dropped"


class TurnOutcome(str, enum.Enum):
    """What became of a claimed handle, as the ingress reports it in `end_turn`."""

    PULLED = "pulled"  # prefill read (part of) the blocks
    UNUSED = "unused"  # verified prefix too short, or reuse off: not read
    FAILED = "failed"  # the turn failed before prefill answered


_OUTCOME_STATE = {
    TurnOutcome.PULLED: HandleState.PULLED,
    TurnOutcome.UNUSED: HandleState.UNUSED,
    TurnOutcome.FAILED: HandleState.FAILED,
}


@dataclass(frozen=True)
class Conversation:
    """What one turn leaves for the next: the decode engine's view of the session."""

    session_id: str
    token_ids: tuple[int, ...]
    prompt_len: int
    text: str | None = None
    """Rendered text that `token_ids` stand for, when known exactly (token-in/token-out)."""
    handle: KVHandle | None = None
    decode_replica: str | None = None


@dataclass(frozen=True)
class Claim:
    """Answer to `begin_turn`. `handle` is single-use: it is now CLAIMED for this lease."""

    lease_id: int
    session_id: str
    conversation: Conversation | None
    handle: KVHandle | None
    miss_reason: str | None = None


@dataclass
class _Record:
    conversation: Conversation
    state: HandleState
    stored_at: float
    expires_at: float
    chain_hashes: list[int] = field(default_factory=list)


@dataclass
class _Lease:
    session_id: str
    handle: KVHandle | None
    deadline: float


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block, each covering every token before it."""
    hashes, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start : start + block_size])))
        hashes.append(prev)
    return hashes


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class HandleStore:
    """Bounded, expiring map of session -> latest conversation and its KV handle.

    Called from one thread at a time (the actor serialises calls). Nothing blocks.
    """

    def __init__(
        self,
        *,
        handle_ttl_s: float,
        decoder_ttl_s: float,
        max_sessions: int,
        max_blocks_per_engine: int,
        index_block_size: int = 32,
        lease_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if handle_ttl_s >= decoder_ttl_s:
            raise ValueError("handle_ttl_s must be shorter than the decode engine's pin time")
        self._ttl = handle_ttl_s
        self._decoder_ttl = decoder_ttl_s
        self._max_sessions = max_sessions
        self._max_blocks = max_blocks_per_engine
        self._block = index_block_size
        self._lease_timeout = lease_timeout_s
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()  # LRU order
        self._index: dict[int, set[str]] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        # Blocks that left the store unread: (engine_id, num_blocks, freed_at on our clock).
        self._abandoned: list[tuple[str, int, float]] = []
        self.counts: Counter[str] = Counter()

    # -- turns ---------------------------------------------------------------------

    def match(self, prompt_ids: Sequence[int], prompt_text: str | None = None) -> tuple[str | None, int]:
        """The stored session this sessionless prompt continues, and how many of its
        tokens agree.

        A stored turn matches when its whole prompt is a prefix of `prompt_ids`, or when
        the text it stands for (prompt + answer) is a prefix of `prompt_text`: the latter
        still matches after token-in/token-out made the stored ids differ from a plain
        tokenization. Candidates come from a block-hash index of stored prompts.
        """
        self._sweep()
        hashes = chain_hashes(prompt_ids, self._block)
        for depth in range(len(hashes) - 1, -1, -1):
            candidates = self._index.get(hashes[depth])
            if not candidates:
                continue
            best: tuple[int, float, str] | None = None
            for session_id in candidates:
                record = self._records[session_id]
                conv = record.conversation
                common = common_prefix_len(conv.token_ids, prompt_ids)
                by_text = prompt_text is not None and conv.text is not None and prompt_text.startswith(conv.text)
                if common < conv.prompt_len and not by_text:
                    continue
                key = (len(conv.token_ids) if by_text else common, record.stored_at, session_id)
                best = key if best is None or key > best else best
            if best is not None:
                return best[2], best[0]
        return None, 0

    def begin_turn(self, session_id: str) -> Claim:
        """Claim the session's handle for one turn. Always returns a lease to end."""
        self._sweep()
        now = self._clock()
        lease_id = next(self._lease_ids)
        record = self._records.get(session_id)
        handle, reason = None, None
        if record is None:
            reason = "no_conversation"
        else:
            self._records.move_to_end(session_id)
            conv = record.conversation
            if conv.handle is None:
                reason = "no_handle" if record.state is HandleState.STORED else record.state.value
            elif record.state is not HandleState.STORED:
                reason = record.state.value
            else:
                handle = conv.handle
                record.state = HandleState.CLAIMED
                self.counts["claimed"] += 1
        if reason is not None:
            self.counts[f"miss_{reason}"] += 1
        self._leases[lease_id] = _Lease(session_id, handle, now + self._lease_timeout)
        return Claim(
            lease_id=lease_id,
            session_id=session_id,
            conversation=record.conversation if record else None,
            handle=handle,
            miss_reason=reason,
        )

    def end_turn(
        self, lease_id: int, outcome: TurnOutcome, conversation: Conversation | None
    ) -> None:
        """Settle a lease: record what became of the claimed handle, store the new turn.

        Called exactly once per `begin_turn`, on every path (the ingress uses `finally`).
        """
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            self.counts["late_end_turn"] += 1
            return
        if lease.handle is not None:
            state = _OUTCOME_STATE[outcome]
            self.counts[state.value] += 1
            if outcome is not TurnOutcome.PULLED:
                self._abandon(lease.handle, self._stored_at(lease.session_id))
            record = self._records.get(lease.session_id)
            if record is not None and record.conversation.handle is lease.handle:
                record.state = state
        if conversation is not None:
            self.put(conversation)

    def put(self, conversation: Conversation) -> None:
        """Store a session's latest turn, superseding the previous one."""
        now = self._clock()
        old = self._records.pop(conversation.session_id, None)
        if old is not None:
            self._unindex(conversation.session_id, old)
            if old.state is HandleState.STORED and old.conversation.handle is not None:
                self._leave(old, HandleState.SUPERSEDED)
        record = _Record(
            conversation=conversation,
            state=HandleState.STORED,
            stored_at=now,
            expires_at=now + self._ttl,
            chain_hashes=chain_hashes(conversation.token_ids[: conversation.prompt_len], self._block),
        )
        self._records[conversation.session_id] = record
        for h in record.chain_hashes:
            self._index.setdefault(h, set()).add(conversation.session_id)
        if conversation.handle is not None:
            self.counts["stored"] += 1
            self._enforce_block_bound(conversation.handle.engine_id)
        while len(self._records) > self._max_sessions:
            session_id, victim = self._records.popitem(last=False)
            self._unindex(session_id, victim)
            if victim.state is HandleState.STORED and victim.conversation.handle is not None:
                self._leave(victim, HandleState.EVICTED)
            self.counts["sessions_evicted"] += 1

    def drop_engine(self, engine_id: str) -> int:
        """Forget every stored handle on `engine_id` (its replica is gone). Returns how many."""
        dropped = 0
        for record in self._records.values():
            handle = record.conversation.handle
            if record.state is HandleState.STORED and handle and handle.engine_id == engine_id:
                record.state = HandleState.DROPPED
                self.counts[HandleState.DROPPED.value] += 1
                dropped += 1
        self._abandoned = [a for a in self._abandoned if a[0] != engine_id]
        return dropped

    # -- introspection ---------------------------------------------------------------

    def pinned_blocks(self, engine_id: str) -> int:
        """Blocks we believe `engine_id` keeps pinned for us: stored, claimed, abandoned."""
        self._sweep()
        return self._waiting_blocks(engine_id) + sum(n for e, n, _ in self._abandoned if e == engine_id)

    def stats(self) -> dict:
        self._sweep()
        states = Counter(
            r.state.value for r in self._records.values() if r.conversation.handle is not None
        )
        engines = {
            r.conversation.handle.engine_id
            for r in self._records.values()
            if r.conversation.handle is not None
        } | {e for e, _, _ in self._abandoned}
        return {
            "sessions": len(self._records),
            "handles": dict(states),
            "open_leases": len(self._leases),
            "claimed_handles": sum(1 for lease in self._leases.values() if lease.handle),
            "pinned_blocks": {e: self.pinned_blocks(e) for e in sorted(engines)},
            "counts": dict(self.counts),
        }

    # -- internals -----------------------------------------------------------------

    def _waiting_blocks(self, engine_id: str) -> int:
        """Blocks of handles still stored or claimed on `engine_id` (not yet abandoned)."""
        return sum(
            r.conversation.handle.num_blocks
            for r in self._records.values()
            if r.conversation.handle is not None
            and r.conversation.handle.engine_id == engine_id
            and r.state in (HandleState.STORED, HandleState.CLAIMED)
        )

    def _stored_at(self, session_id: str) -> float:
        record = self._records.get(session_id)
        return record.stored_at if record else self._clock()

    def _leave(self, record: _Record, state: HandleState) -> None:
        record.state = state
        self.counts[state.value] += 1
        self._abandon(record.conversation.handle, record.stored_at)

    def _abandon(self, handle: KVHandle, stored_at: float) -> None:
        self._abandoned.append((handle.engine_id, handle.num_blocks, stored_at + self._decoder_ttl))

    def _unindex(self, session_id: str, record: _Record) -> None:
        for h in record.chain_hashes:
            sessions = self._index.get(h)
            if sessions is not None:
                sessions.discard(session_id)
                if not sessions:
                    del self._index[h]

    def _enforce_block_bound(self, engine_id: str) -> None:
        # Evicting moves a handle's blocks to `_abandoned` (still pinned until the decoder's
        # TTL), so the bound is on the blocks of waiting handles, which eviction does lower.
        self._sweep()
        for session_id in list(self._records):
            if self._waiting_blocks(engine_id) <= self._max_blocks:
                return
            record = self._records[session_id]
            handle = record.conversation.handle
            if record.state is HandleState.STORED and handle and handle.engine_id == engine_id:
                self._leave(record, HandleState.EVICTED)
                self.counts["evicted_for_blocks"] += 1

    def _sweep(self) -> None:
        now = self._clock()
        for record in self._records.values():
            if record.state is HandleState.STORED and record.conversation.handle and now >= record.expires_at:
                self._leave(record, HandleState.EXPIRED)
        self._abandoned = [a for a in self._abandoned if a[2] > now]
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(lease_id)
            self.counts["lease_expired"] += 1
            if lease.handle is not None:
                self._abandon(lease.handle, now)
                record = self._records.get(lease.session_id)
                if (
                    record is not None
                    and record.conversation.handle is lease.handle
                    and record.state is HandleState.CLAIMED
                ):
                    # Counted as abandoned now; no longer as claimed.
                    record.state = HandleState.EXPIRED


def restrict(handle: KVHandle, prompt_ids: Sequence[int], held_ids: Iterable[int], block_size: int) -> tuple[KVHandle, int]:
    """Cap `handle` to the positions where the decode engine's tokens equal the new
    prompt's, never the prompt's last token (prefill must compute at least one).

    Returns the capped handle and how many held positions drift cut off.
    """
    held = tuple(held_ids)[: handle.num_tokens]
    common = common_prefix_len(held, prompt_ids)
    usable = min(common, len(prompt_ids) - 1)
    drift = max(0, min(handle.num_tokens, len(prompt_ids) - 1) - usable)
    return handle.capped(usable, block_size), drift
