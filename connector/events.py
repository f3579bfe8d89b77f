"""The handle store's vocabularies: every string it emits as a counter key or a reason.

- `Miss`: why `HandleStore.begin_turn` handed out no handle (`Claim.miss_reason`).
  `no_conversation`, `no_handle`, `moving`, or the state of the handle the session's
  record still holds (`claimed`, `pulled`, `unused`, `failed`, `expired`, `evicted`,
  `dropped`).
- `StoreEvent`: the keys of `HandleStore.counts` (`stats()["counts"]`): handle exits by
  state name, claims and misses (`miss_<Miss>`), evictions, late or mismatched turns,
  releases taken, and the work of sessionless matching.
- `TenantEvent`: the per-tenant events of `stats()["tenants"][<namespace>]`.
- `ResponseEvent`: the keys of `ResponseStore.counts` (stored Responses API objects).

All are `StrEnum`s: a member compares and hashes equal to its string, formats as it, and
JSON shows the string, so callers may keep reading counters by plain string;
`HandleStore.stats()` and `Claim.miss_reason` carry the plain strings. Pure Python, no
imports from the project: `connector.store`, `connector.match` and
`connector.response_store` emit them, the ingress (`app.turn.turns`) may use them to read
what the store emitted.
"""

from __future__ import annotations

import enum


class Miss(enum.StrEnum):
    """Why a claim came back without a handle."""

    NO_CONVERSATION = "no_conversation"  # the store keeps no conversation of the session
    NO_HANDLE = "no_handle"  # its conversation was stored without a handle
    CLAIMED = "claimed"  # another turn of the session holds the handle
    PULLED = "pulled"  # read by an earlier turn (single use)
    UNUSED = "unused"  # claimed earlier and not read: its blocks are being released
    FAILED = "failed"  # claimed by a turn that failed
    EXPIRED = "expired"  # the store's TTL or the claiming turn's lease ran out
    EVICTED = "evicted"  # evicted for the engine's pinned-block budget
    DROPPED = "dropped"  # its decode replica is gone
    MOVING = "moving"  # being moved to another decode replica (its replica is draining)

    @property
    def event(self) -> StoreEvent:
        """The counter this miss increments (`miss_<reason>`)."""
        return _MISS_EVENT[self]


class StoreEvent(enum.StrEnum):
    """Keys of `HandleStore.counts`."""

    # A handle entered the store, was claimed, or left it (keyed by the state it left in).
    STORED = "stored"
    CLAIMED = "claimed"
    GIVEN_BACK = "given_back"  # a claim ended KEPT: the handle is STORED again, unread
    PULLED = "pulled"
    UNUSED = "unused"
    FAILED = "failed"
    EXPIRED = "expired"
    EVICTED = "evicted"
    SUPERSEDED = "superseded"
    DROPPED = "dropped"
    ENDED = "ended"
    # `begin_turn` found no handle to claim (`Miss.event`).
    MISS_NO_CONVERSATION = "miss_no_conversation"
    MISS_NO_HANDLE = "miss_no_handle"
    MISS_CLAIMED = "miss_claimed"
    MISS_PULLED = "miss_pulled"
    MISS_UNUSED = "miss_unused"
    MISS_FAILED = "miss_failed"
    MISS_EXPIRED = "miss_expired"
    MISS_EVICTED = "miss_evicted"
    MISS_DROPPED = "miss_dropped"
    MISS_MOVING = "miss_moving"
    # Moves of a draining decode replica's handles to a peer (`begin_move`, `end_move`).
    MOVES_STARTED = "moves_started"
    MOVED = "moved"  # the peer read the blocks and pins them under a new handle
    MOVED_BLOCKS = "moved_blocks"
    MOVE_FAILED = "move_failed"  # the peer could not take them: dropped with the replica
    MOVE_SUPERSEDED = "move_superseded"  # a turn stored a newer conversation meanwhile
    # Leases and turns.
    LEASE_EXPIRED = "lease_expired"  # a claim's lease ran out before `end_turn`
    LATE_END_TURN = "late_end_turn"  # `end_turn` of a lease already settled or expired
    TAIL_MISMATCH = "tail_mismatch"  # a `ConversationTail` that does not extend its claim
    # Sessions and evictions.
    SESSIONS_ENDED = "sessions_ended"
    SESSIONS_EVICTED = "sessions_evicted"  # LRU, by sessions or bytes
    EVICTED_FOR_BYTES = "evicted_for_bytes"  # ... of which for the byte bound
    EVICTED_FOR_BLOCKS = "evicted_for_blocks"  # handles, for an engine's pinned-block budget
    EVICTED_RETAINED = "evicted_retained"  # ... of which retained ones (the tenant had no other)
    SESSIONS_REFUSED = "sessions_refused"  # a new session past its tenant's live-session limit
    RELEASES_TAKEN = "releases_taken"
    # Sessionless matching (`HandleStore.match`).
    MATCH_CANDIDATES = "match_candidates"
    MATCH_COMPARED_TOKENS = "match_compared_tokens"
    MATCH_HASH_COLLISIONS = "match_hash_collisions"


class TenantEvent(enum.StrEnum):
    """Per-tenant events (`HandleStore.tenant_counts`, `stats()["tenants"]`)."""

    SESSIONS_REFUSED = "sessions_refused"  # new sessions refused: the tenant's live-session limit
    EVICTED_FOR_BLOCKS = "evicted_for_blocks"  # handles, for an engine's pinned-block budget


class ResponseEvent(enum.StrEnum):
    """Keys of `ResponseStore.counts` (`stats()["responses"]` of a shard)."""

    STORED = "responses_stored"
    EVICTED = "responses_evicted"  # LRU, for the count bound
    EVICTED_FOR_BYTES = "responses_evicted_for_bytes"  # LRU, for the byte bound (not in the above)
    EXPIRED = "responses_expired"  # unused for the TTL
    DELETED = "responses_deleted"
    REFUSED_TOO_BIG = "responses_refused_too_big"  # larger than the whole byte bound
    FORKED = "responses_forked"  # a second request continued the same response


_MISS_EVENT = {miss: StoreEvent(f"miss_{miss}") for miss in Miss}
