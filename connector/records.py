"""The handle store's value types and pure helpers: what a turn stores, what a claim
hands out, what leaves the store unread, and the hashing and prefix helpers on token ids.

Callers: `connector.store` (the store's lifecycle), `connector.match` (the sessionless
index), `connector.pins` (the pin ledger), `connector.actor` (ships these types between
the ingress and the store's shards) and the ingress (`app.turn.turns`, `restrict`). Pure
Python, no Ray, no state: nothing here changes once built but the caches of
`Conversation`'s two id forms.

A handle's states and the moves between them are `HandleState` and `TRANSITIONS`; the
store changes a state nowhere but through the table (`HandleStore._transition`).
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from connector.handle import KVHandle

DEFAULT_MAX_STORE_BYTES = 4 << 30
"""Bytes of conversations one store (shard) keeps by default before LRU eviction."""


class HandleState(str, enum.Enum):
    """Where a stored conversation's handle is. STORED and CLAIMED are live (the decode
    engine keeps the blocks for us); the others are exits, except NO_HANDLE, the state of
    a conversation stored without a handle (nothing pinned, never claimed)."""

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
    NO_HANDLE = "no_handle"


LIVE_STATES = frozenset({HandleState.STORED, HandleState.CLAIMED})
"""States whose handle still waits to be read (its blocks count against the budget)."""

TRANSITIONS: dict[HandleState | None, frozenset[HandleState]] = {
    None: frozenset({HandleState.STORED, HandleState.NO_HANDLE}),
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
        {HandleState.STORED, HandleState.PULLED, HandleState.UNUSED, HandleState.FAILED, HandleState.EXPIRED}
    ),
}
"""Allowed state changes; `None` is a record entering the store. Every other state is final."""


class TurnOutcome(str, enum.Enum):
    """What became of a claimed handle, as the ingress reports it in `end_turn`."""

    PULLED = "pulled"  # prefill read (part of) the blocks
    UNUSED = "unused"  # verified prefix too short, or reuse off: not read
    FAILED = "failed"  # the turn failed before prefill answered
    KEPT = "kept"  # not this turn's conversation (a sub-agent under its key): back to STORED, unread


OUTCOME_STATE = {
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
    """Why there is no handle: a `connector.events.Miss` value, sent as its plain string."""
    pin_remaining_s: float | None = None
    conversation_known: bool = False
    """The stored conversation is the one the caller said it holds (`begin_turn(known=)`):
    `conversation` is left out, the caller fills in its own copy."""
    retry_after_s: float | None = None
    """Set when the turn is refused: the session is new and its tenant already has its
    maximum of live sessions. No lease was opened (nothing to end); the tenant may start
    a session again in this many seconds."""


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
    ids = compact(token_ids)
    return token_chain(ids.tobytes(), block_size * ids.itemsize, len(ids) // block_size)


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


def compact(token_ids: Sequence[int]) -> array:
    """`token_ids` as an `array('i')`, not copied when it is one (or a `Conversation`'s)."""
    if isinstance(token_ids, array) and token_ids.typecode == "i":
        return token_ids
    if isinstance(token_ids, Conversation):
        return token_ids.compact_ids
    return array("i", token_ids)


def token_chain(data: bytes, width: int, blocks: int, start: int = 0, prev: int = 0) -> list[int]:
    """Chain hashes of blocks `start + 1 .. blocks` of `data` (`width` bytes a block),
    continuing from `prev`, the hash of the first `start` blocks."""
    return [prev := hash((prev, data[o : o + width])) for o in range(start * width, blocks * width, width)]


def text_chain(text: str, width: int, blocks: int, start: int = 0, prev: int = 0) -> list[int]:
    """`token_chain` over `text`, `width` characters a block."""
    return [prev := hash((prev, text[o : o + width])) for o in range(start * width, blocks * width, width)]


RECORD_OVERHEAD = 600
"""Bytes a stored conversation costs besides its ids, text and handle blocks (record,
index and LRU entries), as estimated for `stats()["bytes"]`."""


class Record:
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
        "retained",
    )

    session_id: str
    tokens: array
    prompt_len: int
    text: str | None
    handle: KVHandle | None
    decode_replica: str | None
    state: HandleState | None
    """None until the record enters the store; changed only by `HandleStore._transition`."""
    stored_at: float
    expires_at: float
    # Index fields, set by `MatchIndex.keys`.
    token_keys: tuple[int, ...]
    """Index keys: the chain hashes where the prompt ends and where the tokens end."""
    text_key: int | None
    chain: tuple[int, int]
    """Full blocks of `tokens`, and the chain hash of them."""
    text_chain: tuple[int, int]
    nbytes: int
    retained: bool
    """Its client asked for long retention: budget evictions take it last (`TenantShares.victim`)."""

    def __init__(
        self, conversation: Conversation, stored_at: float, expires_at: float, retained: bool = False
    ):
        self.session_id = conversation.session_id
        self.tokens = tokens = conversation.compact_ids
        self.prompt_len = conversation.prompt_len
        self.text = text = conversation.text
        self.handle = handle = conversation.handle
        self.decode_replica = conversation.decode_replica
        self.state = None
        self.stored_at = stored_at
        self.expires_at = expires_at
        self.retained = retained
        self.nbytes = (
            tokens.itemsize * len(tokens)
            + (sys.getsizeof(text) if text is not None else 0)
            + (36 * handle.num_blocks if handle is not None else 0)
            + RECORD_OVERHEAD
        )

    def conversation(self) -> Conversation:
        return Conversation(
            self.session_id, self.tokens, self.prompt_len, self.text, self.handle, self.decode_replica
        )
