"""Which decode engine holds which conversation's KV: the handle store's logic.

Pure Python, no Ray: `connector.actor` runs it inside Ray actors shared by every ingress
replica, and unit tests drive it directly with a fake clock.

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

and every exit is counted. Every handle that leaves unread (all exits but PULLED and
DROPPED) becomes a `Release` in the store's outbox: `take_releases` hands them to the
caller, which asks the decode engine to free those blocks now. Until then (or until the
decode engine's own TTL, `decoder_kv_blocks_ttl`) the store counts them as pinned.

Scale: every per-turn operation is O(1) or O(log n) in live sessions (expiry and leases
in deadline order, pinned blocks counted incrementally), a sessionless `match` costs one
walk of the prompt plus a bounded number of candidate checks, and a conversation costs
about 4 bytes per token (ids kept as `array('i')`) plus its text.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import sys
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from connector.handle import KVHandle
from connector.shares import TenantShares, tenant_of

DEFAULT_MAX_STORE_BYTES = 4 << 30
"""Bytes of conversations one store (shard) keeps by default before LRU eviction."""

MATCH_FANOUT = 16
"""Most recent candidates examined per index key in `match` (sessions whose stored
tokens end on the very same block chain, e.g. identical prompts with short answers)."""

_RECORD_OVERHEAD = 600
"""Bytes a stored conversation costs besides its ids, text and handle blocks (record,
index and LRU entries), as estimated for `stats()["bytes"]`."""


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
    ENDED = "ended"


_TRANSITIONS: dict[HandleState, frozenset[HandleState]] = {
    HandleState.STORED: frozenset(
        {
            HandleState.CLAIMED,
            HandleState.EXPIRED,
            HandleState.EVICTED,
            HandleState.SUPERSEDED,
            HandleState.DROPPED,
            HandleState.ENDED,
        }
    ),
    HandleState.CLAIMED: frozenset(
        {HandleState.PULLED, HandleState.UNUSED, HandleState.FAILED, HandleState.EXPIRED}
    ),
}
"""Allowed handle transitions; every other state is final."""


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


class Conversation:
    """What one turn leaves for the next: the decode engine's view of the session.

    Immutable. `token_ids` reads as a tuple (what callers compute with); the ids are kept
    compact (`compact_ids`, an `array('i')`, 4 bytes a token) and are pickled that way,
    so the store keeps and ships them without converting: the tuple is built once, on
    first read, in the process that reads it. An `array('i')` given to the constructor is
    kept as is and must not be changed afterwards.
    """

    __slots__ = ("session_id", "prompt_len", "text", "handle", "decode_replica", "_ids", "_tuple")

    # Set once, in `__init__` (through `object.__setattr__`: the instance is immutable).
    session_id: str
    prompt_len: int
    text: str | None
    handle: KVHandle | None
    decode_replica: str | None
    # The ids in one form or both: `_ids` compact, `_tuple` as read; whichever is missing
    # is built on first use (never both None).
    _ids: array | None
    _tuple: tuple[int, ...] | None

    def __init__(
        self,
        session_id: str,
        token_ids: Sequence[int],
        prompt_len: int,
        text: str | None = None,
        handle: KVHandle | None = None,
        decode_replica: str | None = None,
    ):
        setter = object.__setattr__
        setter(self, "session_id", session_id)
        setter(self, "prompt_len", prompt_len)
        setter(self, "text", text)
        """Rendered text that `token_ids` stand for, when known exactly (token-in/token-out)."""
        setter(self, "handle", handle)
        setter(self, "decode_replica", decode_replica)
        is_compact = isinstance(token_ids, array) and token_ids.typecode == "i"
        setter(self, "_ids", token_ids if is_compact else None)
        setter(self, "_tuple", None if is_compact else tuple(token_ids))

    @property
    def token_ids(self) -> tuple[int, ...]:
        ids = self._tuple
        if ids is None:
            assert self._ids is not None
            ids = tuple(self._ids)
            object.__setattr__(self, "_tuple", ids)
        return ids

    @property
    def compact_ids(self) -> array:
        ids = self._ids
        if ids is None:
            assert self._tuple is not None
            ids = array("i", self._tuple)
            object.__setattr__(self, "_ids", ids)
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self._ids) if self._ids is not None else len(self.token_ids)

    def __setattr__(self, name, value):
        raise AttributeError("Conversation is immutable")

    def __reduce__(self):
        return (
            Conversation,
            (self.session_id, self.compact_ids, self.prompt_len, self.text, self.handle, self.decode_replica),
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, Conversation):
            return NotImplemented
        return (
            self.session_id == other.session_id
            and self.prompt_len == other.prompt_len
            and self.text == other.text
            and self.handle == other.handle
            and self.decode_replica == other.decode_replica
            and self.compact_ids == other.compact_ids
        )

    def __hash__(self) -> int:
        return hash((self.session_id, self.prompt_len, self.num_tokens))

    def __repr__(self) -> str:
        return (
            f"Conversation(session_id={self.session_id!r}, tokens={self.num_tokens}, "
            f"prompt_len={self.prompt_len}, handle={self.handle!r}, decode_replica={self.decode_replica!r})"
        )


@dataclass(frozen=True, slots=True)
class ConversationTail:
    """A new turn sent to the store as what it adds to the conversation its lease claimed.

    Agents' conversations grow by appending: a turn's tokens are the previous turn's plus
    the new message and the answer. Sending only that tail keeps a turn's store traffic
    to a few KiB however long the conversation is (a full 32k-token conversation is
    ~256 KiB of ids and text). The store rebuilds the conversation from the one it handed
    out with the lease, which both sides hold unchanged.
    """

    session_id: str
    base_tokens: int
    """Tokens of the claimed conversation this extends (checked by the store)."""
    ids: array
    text: str | None
    prompt_len: int
    handle: KVHandle | None
    decode_replica: str | None

    @classmethod
    def of(cls, conversation: Conversation, base: Conversation) -> ConversationTail | None:
        """`conversation` as a tail over `base`; None when it does not extend it (ids and
        rendered text both start with `base`'s, or neither has text)."""
        if conversation.session_id != base.session_id or (conversation.text is None) != (base.text is None):
            return None
        n = base.num_tokens
        ids = conversation.compact_ids
        if len(ids) < n or ids[:n] != base.compact_ids:
            return None
        text = None
        if conversation.text is not None and base.text is not None:  # both or neither (above)
            if not conversation.text.startswith(base.text):
                return None
            text = conversation.text[len(base.text) :]
        return cls(
            conversation.session_id,
            n,
            ids[n:],
            text,
            conversation.prompt_len,
            conversation.handle,
            conversation.decode_replica,
        )

    def __reduce__(self):  # positional: cheaper than the dataclass's own field-by-field state
        return (
            ConversationTail,
            (
                self.session_id,
                self.base_tokens,
                self.ids,
                self.text,
                self.prompt_len,
                self.handle,
                self.decode_replica,
            ),
        )

    def over(self, base_ids: array, base_text: str | None) -> Conversation | None:
        """The whole conversation, given the claimed one's ids and text; None if they are
        not what this tail was cut from."""
        if len(base_ids) != self.base_tokens or (base_text is None) != (self.text is None):
            return None
        text = base_text + self.text if base_text is not None and self.text is not None else None
        return Conversation(
            self.session_id, base_ids + self.ids, self.prompt_len, text, self.handle, self.decode_replica
        )


@dataclass(frozen=True)
class Claim:
    """Answer to `begin_turn`. `handle` is single-use: it is now CLAIMED for this lease.

    `pin_remaining_s`: seconds, from the claim, until the decode engine lets the
    handle's blocks go (its `decoder_kv_blocks_ttl` counted from when the turn was
    stored); None without a handle. A pull that cannot finish within it must not start.
    """

    lease_id: int
    session_id: str
    conversation: Conversation | None
    handle: KVHandle | None
    miss_reason: str | None = None
    pin_remaining_s: float | None = None
    conversation_known: bool = False
    """The stored conversation is the one the caller said it holds (`begin_turn(known=)`):
    `conversation` is left out, the caller fills in its own copy."""


@dataclass(frozen=True)
class Release:
    """A handle that left the store unread: its decode engine may free the blocks now."""

    engine_id: str
    request_id: str
    decode_replica: str | None
    num_blocks: int
    reason: HandleState


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block, each covering every token before it (this process only)."""
    ids = _compact(token_ids)
    return _token_chain(ids.tobytes(), block_size * ids.itemsize, len(ids) // block_size)


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b`, given that the first `start` agree.

    Same-typed sequences are compared a chunk at a time in C."""
    n = min(len(a), len(b))
    i = start
    if type(a) is type(b) and isinstance(a, (tuple, list, array)):
        while i < n:
            hi = min(i + 256, n)
            if a[i:hi] != b[i:hi]:
                break
            i = hi
        else:
            return n
    for j in range(i, n):
        if a[j] != b[j]:
            return j
    return n


def restrict(
    handle: KVHandle, prompt_ids: Sequence[int], held_ids: Iterable[int], block_size: int
) -> tuple[KVHandle, int]:
    """Cap `handle` to the positions where the decode engine's tokens equal the new
    prompt's, never the prompt's last token (prefill must compute at least one).

    Returns the capped handle and how many held positions drift cut off.
    """
    held = tuple(held_ids)[: handle.num_tokens]
    common = common_prefix_len(held, tuple(prompt_ids))
    usable = min(common, len(prompt_ids) - 1)
    drift = max(0, min(handle.num_tokens, len(prompt_ids) - 1) - usable)
    return handle.capped(usable, block_size), drift


# -- internals ------------------------------------------------------------------------------


def _compact(token_ids: Sequence[int]) -> array:
    if isinstance(token_ids, array) and token_ids.typecode == "i":
        return token_ids
    if isinstance(token_ids, Conversation):
        return token_ids.compact_ids
    return array("i", token_ids)


def _token_chain(data: bytes, width: int, blocks: int, start: int = 0, prev: int = 0) -> list[int]:
    """Chain hashes of blocks `start + 1 .. blocks` of `data` (`width` bytes a block),
    continuing from `prev`, the hash of the first `start` blocks."""
    return [prev := hash((prev, data[o : o + width])) for o in range(start * width, blocks * width, width)]


def _text_chain(text: str, width: int, blocks: int, start: int = 0, prev: int = 0) -> list[int]:
    return [prev := hash((prev, text[o : o + width])) for o in range(start * width, blocks * width, width)]


class _Record:
    """One stored conversation, compact: the store's own form of a `Conversation`."""

    __slots__ = (
        "session_id",
        "tokens",
        "prompt_len",
        "text",
        "handle",
        "decode_replica",
        "state",
        "stored_at",
        "expires_at",
        "token_keys",
        "text_key",
        "chain",
        "text_chain",
        "nbytes",
    )

    # All set by `HandleStore._record`.
    session_id: str
    tokens: array
    prompt_len: int
    text: str | None
    handle: KVHandle | None
    decode_replica: str | None
    state: HandleState
    stored_at: float
    expires_at: float
    token_keys: tuple[int, ...]
    """Index keys: the chain hashes where the prompt ends and where the tokens end."""
    text_key: int | None
    chain: tuple[int, int]
    """Full blocks of `tokens`, and the chain hash of them."""
    text_chain: tuple[int, int]
    nbytes: int

    def conversation(self) -> Conversation:
        return Conversation(
            self.session_id, self.tokens, self.prompt_len, self.text, self.handle, self.decode_replica
        )


class _Lease:
    __slots__ = ("session_id", "handle", "decode_replica", "stored_at", "deadline", "ended", "base")

    def __init__(self, session_id, handle, decode_replica, stored_at, deadline, base=None):
        self.session_id = session_id
        self.handle = handle
        self.decode_replica = decode_replica
        self.stored_at = stored_at
        self.deadline = deadline
        self.ended = False
        self.base = base
        """(ids, text) of the conversation handed out with the claim: what a
        `ConversationTail` ending this lease extends."""


class _PinLedger:
    """Blocks each decode engine keeps pinned for us, kept incrementally.

    `waiting`: blocks of handles still STORED or CLAIMED; `unread`: blocks of handles
    that left unread, until their release is taken or the decode engine's TTL frees
    them. The outbox of releases is exactly the unread handles."""

    def __init__(self, decoder_ttl_s: float, default_budget: int, pinned_fraction: float):
        self._decoder_ttl = decoder_ttl_s
        self._default_budget = default_budget
        self._fraction = pinned_fraction
        self.budgets: dict[str, int] = {}
        self.waiting: Counter[str] = Counter()
        self.unread: Counter[str] = Counter()
        self._outbox: dict[tuple[str, str], tuple[Release, float]] = {}
        self._deadlines: list[tuple[float, str, str]] = []  # heap; entries gone from the outbox are stale
        self._gone: set[str] = set()

    def budget(self, engine_id: str) -> int:
        return self.budgets.get(engine_id, self._default_budget)

    def knows(self, engine_id: str) -> bool:
        """Whether the engine's capacity was set (else the default budget applies)."""
        return engine_id in self.budgets

    def set_capacity(self, engine_id: str, total_blocks: int) -> None:
        self.budgets[engine_id] = math.floor(self._fraction * total_blocks)

    def pinned(self, engine_id: str) -> int:
        return self.waiting[engine_id] + self.unread[engine_id]

    def engines(self) -> set[str]:
        return {e for e, n in self.waiting.items() if n} | {e for e, n in self.unread.items() if n}

    def hold(self, handle: KVHandle) -> None:
        self.waiting[handle.engine_id] += handle.num_blocks

    def let_go(
        self, handle: KVHandle, reason: HandleState, stored_at: float, decode_replica: str | None, now: float
    ) -> None:
        """A held handle leaves; unless it was read or its engine is gone, its release
        goes to the outbox and its blocks stay counted until taken or freed by the TTL."""
        self.waiting[handle.engine_id] -= handle.num_blocks
        if reason not in (HandleState.PULLED, HandleState.DROPPED):
            self.unread_handle(handle, reason, stored_at, decode_replica, now)

    def unread_handle(
        self, handle: KVHandle, reason: HandleState, stored_at: float, decode_replica: str | None, now: float
    ) -> None:
        """A handle nobody will read (held or never stored): release it."""
        freed_at = stored_at + self._decoder_ttl
        key = (handle.engine_id, handle.request_id)
        if handle.engine_id in self._gone or freed_at <= now or key in self._outbox:
            return
        release = Release(handle.engine_id, handle.request_id, decode_replica, handle.num_blocks, reason)
        self._outbox[key] = (release, freed_at)
        heapq.heappush(self._deadlines, (freed_at, *key))
        self.unread[handle.engine_id] += handle.num_blocks

    def take(self) -> list[Release]:
        out = [release for release, _ in self._outbox.values()]
        for release in out:
            self.unread[release.engine_id] -= release.num_blocks
        self._outbox.clear()
        return out

    def sweep(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            freed_at, engine_id, request_id = heapq.heappop(self._deadlines)
            key = (engine_id, request_id)
            entry = self._outbox.get(key)
            if entry is not None and entry[1] == freed_at:
                del self._outbox[key]
                self.unread[entry[0].engine_id] -= entry[0].num_blocks

    def forget_engine(self, engine_id: str) -> None:
        """The engine is gone: nothing of it is pinned or to be released any more."""
        self._gone.add(engine_id)
        for key in [k for k in self._outbox if k[0] == engine_id]:
            del self._outbox[key]
        self.unread[engine_id] = 0

    @property
    def pending(self) -> int:
        return len(self._outbox)


class HandleStore:
    """Bounded, expiring map of session -> latest conversation and its KV handle.

    Called from one thread at a time (the actor serialises calls). Nothing blocks.
    Expiry and lease deadlines are kept in insertion order, which is deadline order
    because their TTLs are uniform and `clock` is monotonic.
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
        self._block = index_block_size
        self._text_block = text_block_chars
        self._fanout = match_fanout
        self._lease_timeout = lease_timeout_s
        self._clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()  # LRU order
        self._bytes = 0
        self._expiring: OrderedDict[str, _Record] = OrderedDict()  # STORED handles, by expiry
        self._stored_on: dict[str, dict[str, None]] = {}  # engine -> STORED sessions, oldest first
        self._token_index: dict[int, dict[str, None]] = {}  # chain hash -> sessions, oldest first
        self._text_index: dict[int, dict[str, None]] = {}
        self._leases: OrderedDict[int, _Lease] = OrderedDict()  # by deadline
        self._open: dict[str, set[int]] = {}  # session -> its open leases
        self._lease_ids = itertools.count(1)
        self._claimed = 0
        self._states: Counter[HandleState] = Counter()  # states of live records' handles
        self._pins = _PinLedger(decoder_ttl_s, max_blocks_per_engine, pinned_fraction)
        self._shares = TenantShares(tenant_weights, tenant_max_sessions)
        """Per tenant (`connector.shares`): shares of each engine's budget, kept sessions."""
        self.counts: Counter[str] = Counter()
        self.tenant_counts: Counter[tuple[str, str]] = Counter()
        """(tenant namespace, event): evictions for blocks and for the tenant's session limit."""

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
        best = self._match_tokens(_compact(prompt_ids))
        if prompt_text is not None:
            by_text = self._match_text(prompt_text)
            if by_text is not None and (best is None or by_text > best):
                best = by_text
        return (best[2], best[0]) if best is not None else (None, 0)

    def begin_turn(self, session_id: str, known: str | None = None) -> Claim:
        """Claim the session's handle for one turn. Always returns a lease to end.

        `known`: the request id of the handle of the conversation the caller already holds
        (the turn it stored last); if that is the stored one, it is not sent back."""
        self._sweep()
        now = self._clock()
        lease_id = next(self._lease_ids)
        record = self._records.get(session_id)
        handle, reason, remaining = None, None, None
        if record is None:
            reason = "no_conversation"
        else:
            self._records.move_to_end(session_id)
            self._shares.touch(tenant_of(session_id), session_id)
            if record.handle is None:
                reason = "no_handle"
            elif record.state is not HandleState.STORED:
                reason = record.state.value
            else:
                handle = record.handle
                self._transition(record, HandleState.CLAIMED)
                remaining = record.stored_at + self._decoder_ttl - now
                self._claimed += 1
                self.counts["claimed"] += 1
        if reason is not None:
            self.counts[f"miss_{reason}"] += 1
        stored_at = record.stored_at if record is not None else now
        self._leases[lease_id] = _Lease(
            session_id,
            handle,
            record.decode_replica if record else None,
            stored_at,
            now + self._lease_timeout,
            (record.tokens, record.text) if record is not None else None,
        )
        self._open.setdefault(session_id, set()).add(lease_id)
        same = (
            known is not None
            and record is not None
            and record.handle is not None
            and record.handle.request_id == known
        )
        return Claim(
            lease_id=lease_id,
            session_id=session_id,
            conversation=record.conversation() if record and not same else None,
            handle=handle,
            miss_reason=reason,
            pin_remaining_s=remaining,
            conversation_known=same,
        )

    def end_turn(
        self,
        lease_id: int,
        outcome: TurnOutcome,
        conversation: Conversation | ConversationTail | None,
        engine_blocks: int | None = None,
    ) -> None:
        """Settle a lease: record what became of the claimed handle, store the new turn.

        `engine_blocks`: the block count of the decode engine the new turn's handle pins
        on, when the caller knows it. A store that has no budget for that engine (it was
        restarted empty, or never told) takes it, as `set_engine_capacity` would.

        Called exactly once per `begin_turn`, on every path (the ingress uses `finally`).
        A late call (lease expired) or one for a session ended meanwhile stores nothing;
        the new turn's handle is then released. The new turn may come as a
        `ConversationTail` over the conversation the claim handed out; one that does not
        fit it is not stored (`tail_mismatch`) and its handle is released.
        """
        now = self._clock()
        lease = self._pop_lease(lease_id)
        if lease is None:
            self.counts["late_end_turn"] += 1
            self._release_new(conversation, HandleState.EXPIRED, now)
            return
        if lease.handle is not None:
            state = _OUTCOME_STATE[outcome]
            self._settle(lease, state, now)
        if lease.ended:
            self._release_new(conversation, HandleState.ENDED, now)
            return
        base = None
        if isinstance(conversation, ConversationTail):
            tail = conversation
            conversation = tail.over(*lease.base) if lease.base is not None else None
            if conversation is None:
                self.counts["tail_mismatch"] += 1
                self._release_new(tail, HandleState.DROPPED, now)
                return
            base = lease.base
        if conversation is not None:
            if (
                engine_blocks
                and conversation.handle is not None
                and not self._pins.knows(conversation.handle.engine_id)
            ):
                self._pins.set_capacity(conversation.handle.engine_id, engine_blocks)
            self.put(conversation, base)

    def put(self, conversation: Conversation, base: tuple[array, str | None] | None = None) -> None:
        """Store a session's latest turn, superseding the previous one. `base`: ids and
        text the turn is known to start with (a resolved `ConversationTail`)."""
        self._sweep()
        now = self._clock()
        session_id = conversation.session_id
        old = self._records.get(session_id)
        if old is not None:
            if old.state is HandleState.STORED and old.handle is not None:
                self._leave(old, HandleState.SUPERSEDED)
            self._remove(old)
        record = self._record(conversation, old, now, base)
        self._records[session_id] = record
        tenant = tenant_of(session_id)
        self._shares.touch(tenant, session_id)
        self._bytes += record.nbytes
        for key in record.token_keys:
            self._token_index.setdefault(key, {})[session_id] = None
        if record.text_key is not None:
            self._text_index.setdefault(record.text_key, {})[session_id] = None
        if record.handle is not None:
            self._states[HandleState.STORED] += 1
            self._pins.hold(record.handle)
            self._shares.hold(record.handle.engine_id, tenant, record.handle.num_blocks)
            self._stored_on.setdefault(record.handle.engine_id, {})[session_id] = None
            self._shares.stored(record.handle.engine_id, tenant, session_id)
            self._expiring[session_id] = record
            self.counts["stored"] += 1
            self._enforce_budget(record.handle.engine_id)
        while (oldest := self._shares.over_session_limit(tenant)) is not None and oldest != session_id:
            victim = self._records[oldest]
            if victim.state is HandleState.STORED and victim.handle is not None:
                self._leave(victim, HandleState.EVICTED)
            self._remove(victim)
            self.counts["sessions_evicted_for_tenant_limit"] += 1
            self.tenant_counts[(tenant, "sessions_evicted")] += 1
        while self._records and (len(self._records) > self._max_sessions or self._bytes > self._max_bytes):
            victim = next(iter(self._records.values()))
            if len(self._records) <= self._max_sessions:
                self.counts["evicted_for_bytes"] += 1
            if victim.state is HandleState.STORED and victim.handle is not None:
                self._leave(victim, HandleState.EVICTED)
            self._remove(victim)
            self.counts["sessions_evicted"] += 1

    def end_session(self, session_id: str) -> bool:
        """Forget a session now (the client ended it). Its stored handle is released
        (reason ENDED); a turn of it still in flight settles its claim, but its new turn
        is released rather than stored. Returns False if the store kept no such session."""
        self._sweep()
        record = self._records.get(session_id)
        open_leases = self._open.get(session_id, ())
        if record is None and not open_leases:
            return False
        for lease_id in open_leases:
            self._leases[lease_id].ended = True
        if record is not None:
            if record.state is HandleState.STORED and record.handle is not None:
                self._leave(record, HandleState.ENDED)
            self._remove(record)
        self.counts["sessions_ended"] += 1
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
        self.counts["releases_taken"] += len(releases)
        return releases

    # -- introspection ---------------------------------------------------------------

    def pinned_blocks(self, engine_id: str) -> int:
        """Blocks we believe `engine_id` keeps pinned for us: stored, claimed, and left
        unread (until their release is taken or the decode engine's TTL passed)."""
        self._sweep()
        return self._pins.pinned(engine_id)

    def stats(self) -> dict:
        self._sweep()
        sessions = len(self._records)
        return {
            "sessions": sessions,
            "handles": {state.value: n for state, n in self._states.items() if n},
            "open_leases": len(self._leases),
            "claimed_handles": self._claimed,
            "pinned_blocks": {e: self._pins.pinned(e) for e in sorted(self._pins.engines())},
            "pin_budgets": dict(self._pins.budgets),
            "pending_releases": self._pins.pending,
            "bytes": self._bytes,
            "bytes_per_session": self._bytes // sessions if sessions else 0,
            "counts": dict(self.counts),
            "tenants": self._tenant_stats(),
        }

    def _tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant namespace (a hash of its key, never the key): sessions kept, blocks
        pinned, evictions."""
        out = self._shares.stats()
        for (tenant, event), n in self.tenant_counts.items():
            out.setdefault(tenant, {"sessions": 0, "pinned_blocks": 0})[event] = n
        return out

    # -- internals -----------------------------------------------------------------

    def _record(self, conversation: Conversation, old: _Record | None, now: float, base=None) -> _Record:
        record = _Record()
        tokens = conversation.compact_ids
        text = conversation.text
        record.session_id = conversation.session_id
        record.tokens = tokens
        record.prompt_len = conversation.prompt_len
        record.text = text
        record.handle = conversation.handle
        record.decode_replica = conversation.decode_replica
        record.state = HandleState.STORED
        record.stored_at = now
        record.expires_at = now + self._ttl
        # Index keys: the chain hash where the prompt ends and where the tokens end,
        # continuing the previous turn's chain when this turn extends it.
        block = self._block
        prompt_blocks, all_blocks = record.prompt_len // block, len(tokens) // block
        start, prev = 0, 0
        if old is not None and old.chain[0] <= prompt_blocks:
            n = old.chain[0] * block
            if (base is not None and base[0] is old.tokens) or tokens[:n] == old.tokens[:n]:
                start, prev = old.chain
        # Only the blocks past the previous chain are read (a turn adds a few to thousands).
        hashes = _token_chain(
            tokens[start * block : all_blocks * block].tobytes(),
            block * tokens.itemsize,
            all_blocks - start,
            0,
            prev,
        )

        def at(blocks: int) -> int:
            """Chain hash of the first `blocks` blocks (0 for none)."""
            return 0 if blocks == 0 else prev if blocks == start else hashes[blocks - start - 1]

        # A prompt shorter than one block is not indexed at all.
        keys = (at(prompt_blocks), at(all_blocks)) if prompt_blocks else ()
        record.token_keys = tuple(dict.fromkeys(keys))
        record.chain = (all_blocks, at(all_blocks))
        record.text_key, record.text_chain = None, (0, 0)
        if text is not None:
            width = self._text_block
            blocks, start, prev = len(text) // width, 0, 0
            if old is not None and old.text is not None:
                n = old.text_chain[0] * width
                if (base is not None and base[1] is old.text) or (
                    n <= len(text) and text[:n] == old.text[:n]
                ):
                    start, prev = old.text_chain
            text_hashes = _text_chain(text, width, blocks, start, prev)
            last = text_hashes[-1] if text_hashes else prev
            record.text_chain = (blocks, last)
            record.text_key = last if blocks else None
        handle_bytes = 36 * record.handle.num_blocks if record.handle is not None else 0
        record.nbytes = (
            tokens.itemsize * len(tokens)
            + (sys.getsizeof(text) if text is not None else 0)
            + handle_bytes
            + _RECORD_OVERHEAD
        )
        return record

    def _match_tokens(self, prompt: array) -> tuple[int, float, str] | None:
        block = self._block
        hashes = _token_chain(prompt.tobytes(), block * prompt.itemsize, len(prompt) // block)
        for blocks in range(len(hashes), 0, -1):
            bucket = self._token_index.get(hashes[blocks - 1])
            if not bucket:
                continue
            base = blocks * block
            best = None
            for session_id in islice(reversed(bucket), self._fanout):
                record = self._records[session_id]
                self.counts["match_candidates"] += 1
                tokens, end = record.tokens, record.prompt_len
                if end > len(prompt):
                    continue
                if end > base:  # the prompt's tail past the hashed blocks (under a block)
                    self.counts["match_compared_tokens"] += end - base
                    if tokens[base:end] != prompt[base:end]:
                        continue
                agree = common_prefix_len(tokens, prompt, max(base, end))
                self.counts["match_compared_tokens"] += agree - max(base, end) + 1
                key = (agree, record.stored_at, session_id)
                best = key if best is None or key > best else best
            if best is None:
                continue
            # One candidate verified token by token over the hashed blocks.
            self.counts["match_compared_tokens"] += base
            if self._records[best[2]].tokens[:base] == prompt[:base]:
                return best
            self.counts["match_hash_collisions"] += 1
        return None

    def _match_text(self, text: str) -> tuple[int, float, str] | None:
        width = self._text_block
        hashes = _text_chain(text, width, len(text) // width)
        for blocks in range(len(hashes), 0, -1):
            bucket = self._text_index.get(hashes[blocks - 1])
            if not bucket:
                continue
            best = None
            for session_id in islice(reversed(bucket), self._fanout):
                record = self._records[session_id]
                self.counts["match_candidates"] += 1
                if record.text is not None and text.startswith(record.text):
                    key = (len(record.tokens), record.stored_at, session_id)
                    best = key if best is None or key > best else best
            if best is not None:
                return best
        return None

    def _transition(self, record: _Record, state: HandleState) -> None:
        """The one place a handle's state changes (checked against `_TRANSITIONS`)."""
        if state not in _TRANSITIONS.get(record.state, ()):
            raise AssertionError(f"handle of {record.session_id}: {record.state.value} -> {state.value}")
        if record.state is HandleState.STORED:
            handle = record.handle
            assert handle is not None  # only records with a handle change state
            self._expiring.pop(record.session_id, None)
            stored = self._stored_on[handle.engine_id]
            del stored[record.session_id]
            if not stored:
                del self._stored_on[handle.engine_id]
            self._shares.unstored(handle.engine_id, tenant_of(record.session_id), record.session_id)
        if self._records.get(record.session_id) is record:
            self._states[record.state] -= 1
            self._states[state] += 1
        record.state = state

    def _leave(self, record: _Record, state: HandleState) -> None:
        """A STORED handle leaves without being claimed."""
        self._transition(record, state)
        handle = record.handle
        assert handle is not None  # only records with a handle leave
        self.counts[state.value] += 1
        self._pins.let_go(handle, state, record.stored_at, record.decode_replica, self._clock())
        self._shares.let_go(handle.engine_id, tenant_of(record.session_id), handle.num_blocks)

    def _settle(self, lease: _Lease, state: HandleState, now: float) -> None:
        """A claimed handle's lease ends: read, unused, failed (counted by state), or
        timed out (counted as `lease_expired`)."""
        self._claimed -= 1
        if state is not HandleState.EXPIRED:
            self.counts[state.value] += 1
        self._pins.let_go(lease.handle, state, lease.stored_at, lease.decode_replica, now)
        self._shares.let_go(lease.handle.engine_id, tenant_of(lease.session_id), lease.handle.num_blocks)
        record = self._records.get(lease.session_id)
        if record is not None and record.handle is lease.handle and record.state is HandleState.CLAIMED:
            self._transition(record, state)

    def _release_new(
        self, conversation: Conversation | ConversationTail | None, reason: HandleState, now: float
    ) -> None:
        if conversation is not None and conversation.handle is not None:
            self._pins.unread_handle(conversation.handle, reason, now, conversation.decode_replica, now)

    def _remove(self, record: _Record) -> None:
        """Take a record out of the map, its index entries and the bytes count."""
        session_id = record.session_id
        del self._records[session_id]
        self._shares.forget(tenant_of(session_id), session_id)
        self._bytes -= record.nbytes
        if record.handle is not None:
            self._states[record.state] -= 1
        for key in record.token_keys:
            self._unindex(self._token_index, key, session_id)
        if record.text_key is not None:
            self._unindex(self._text_index, record.text_key, session_id)

    @staticmethod
    def _unindex(index: dict[int, dict[str, None]], key: int, session_id: str) -> None:
        bucket = index.get(key)
        if bucket is not None:
            bucket.pop(session_id, None)
            if not bucket:
                del index[key]

    def _pop_lease(self, lease_id: int) -> _Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            open_leases = self._open[lease.session_id]
            open_leases.discard(lease_id)
            if not open_leases:
                del self._open[lease.session_id]
        return lease

    def _enforce_budget(self, engine_id: str) -> None:
        # The budget bounds blocks of waiting handles (stored or claimed); evicting stored
        # ones lowers it, the oldest of the tenant most over its share first
        # (`TenantShares.victim`). Unread blocks are being released.
        budget = self._pins.budget(engine_id)
        while (
            self._pins.waiting[engine_id] > budget
            and (session_id := self._shares.victim(engine_id)) is not None
        ):
            self._leave(self._records[session_id], HandleState.EVICTED)
            self.counts["evicted_for_blocks"] += 1
            self.tenant_counts[(tenant_of(session_id), "evicted_for_blocks")] += 1

    def _sweep(self) -> None:
        now = self._clock()
        while self._expiring:
            record = next(iter(self._expiring.values()))
            if record.expires_at > now:
                break
            self._leave(record, HandleState.EXPIRED)
        while self._leases:
            lease_id, lease = next(iter(self._leases.items()))
            if lease.deadline > now:
                break
            self._pop_lease(lease_id)
            self.counts["lease_expired"] += 1
            if lease.handle is not None:
                self._settle(lease, HandleState.EXPIRED, now)
        self._pins.sweep(now)
