"""The ingress's vocabularies: every counter key of a turn and every reason a turn did
not reuse the decode engine's KV.

- `MissReason`: `TurnResult.miss_reason` (the client's `kvturn.miss_reason`): the store's
  own reasons (`connector.events.Miss`) and the ones the pipeline finds itself.
- `TurnCount`: the keys of `Turns.counts`, shared by the decode memory, exported as
  Prometheus `kvturn_turn_events{event}` and shown in `/v1/kv/stats` (`turns`).

`StrEnum`s, like the store's: a member is its string, so JSON and metric tags show the
string, and a misspelt member fails at import instead of starting a new counter.
"""

from __future__ import annotations

import enum

from app.turn.placement import Reason as Placed
from connector.events import Miss
from connector.records import HandleState


class MissReason(enum.StrEnum):
    NO_CONVERSATION = "no_conversation"
    NO_HANDLE = "no_handle"
    CLAIMED = "claimed"
    PULLED = "pulled"
    UNUSED = "unused"
    FAILED = "failed"
    EXPIRED = "expired"
    EVICTED = "evicted"
    DROPPED = "dropped"
    MOVING = "moving"
    # Found by the pipeline.
    PIN_DEADLINE = "pin_deadline"  # a pull could not end before decode lets the blocks go
    REPLICA_GONE = "replica_gone"  # the session's decode replica died
    PREFIX_MISMATCH = "prefix_mismatch"  # the prompt does not extend the stored tokens
    TOO_SHORT = "too_short"  # less history in common than the recompute threshold

    @property
    def counter(self) -> TurnCount:
        """The counter this miss increments (`miss_<reason>`)."""
        return TurnCount(f"miss_{self.value}")


class Continuation(enum.StrEnum):
    """How a streamed answer goes on after its decode replica failed mid-stream
    (`app.turn.legs.continuation_of`)."""

    RESUMED = "resumed"
    """The survivor computes the prompt plus the tokens sent and generates the rest."""
    REPLAYED_GRAMMAR = "replayed_grammar"
    """Structured output: vLLM starts a request's grammar at its first generated token and
    never feeds it the prompt, so the survivor generates the answer again from the start
    and the tokens the client has are dropped (they must come out the same)."""
    REPLAYED_OUTPUT = "replayed_output"
    """Settings that read the answer so far (stop strings, presence/frequency penalties,
    bad words, a thinking budget, seeded sampling): replayed as for a grammar."""

    @property
    def counter(self) -> TurnCount:
        return TurnCount(f"decode_continued_{self.value}")

    def of_replica(self, replica: str | None) -> str:
        """The counter key of one continuation away from `replica` (per replica, exported
        as `kvturn_decode_continuations{how,replica}`; `/v1/kv/stats` shows it in `turns`)."""
        return f"{CONTINUED_FROM}{self.value}/{replica or 'unknown'}"


CONTINUED_FROM = "decode_continued_from/"
"""Prefix of the per-replica continuation keys of `Turns.counts` (`Continuation.of_replica`)."""


class TurnCount(enum.StrEnum):
    # Turns and tokens.
    TURNS = "turns"
    PROMPT_TOKENS = "prompt_tokens"
    CACHED_TOKENS = "cached_tokens"
    SPLICED = "spliced"  # token-in/token-out re-used the last answer's ids
    SESSIONLESS_MATCHED = "sessionless_matched"
    SESSIONLESS_NEW = "sessionless_new"
    SESSION_FROM_AGENT = "session_from_agent"  # named by prompt_cache_key or Claude Code's metadata
    SESSION_KEY_DIVERGED = "session_key_diverged"  # the prompt did not extend the keyed conversation
    MAX_TOKENS_CLAMPED = "max_tokens_clamped"  # the answer limit was cut to the context's room
    HOSTED_TOOLS_LEFT_OUT = "hosted_tools_left_out"  # Responses tools the server cannot run
    STORE_UNAVAILABLE = "store_unavailable"
    # The claimed handle.
    HANDLE_USED = "handle_used"
    DRIFT_CUT = "drift_cut"  # the handle was capped to the common prefix
    DRIFT_TOKENS = "drift_tokens"
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
    MISS_PIN_DEADLINE = "miss_pin_deadline"
    MISS_REPLICA_GONE = "miss_replica_gone"
    MISS_PREFIX_MISMATCH = "miss_prefix_mismatch"
    MISS_TOO_SHORT = "miss_too_short"
    # Where the turn was computed.
    DECODE_LOCAL = "decode_local"
    DECODE_LOCAL_BUSY = "decode_local_busy"
    DECODE_LOCAL_CACHED_TOKENS = "decode_local_cached_tokens"
    HOST_HANDOFF = "host_handoff"  # a session a prefill replica hosted, handed to decode
    # Why (`app.turn.placement.Reason`): on decode (short, sooner, busy) or through prefill.
    PLACED_SHORT = "placed_short"
    PLACED_SOONER = "placed_sooner"
    PLACED_BUSY = "placed_busy"
    PLACED_TOO_LONG = "placed_too_long"
    PLACED_ITL = "placed_itl"
    PLACED_LATER = "placed_later"
    PLACED_IDLE = "placed_idle"
    PLACED_NO_REPLICA = "placed_no_replica"
    PLACED_HOSTED = "placed_hosted"
    # The prefill leg.
    PREFILL_TIMEOUT = "prefill_timeout"
    PREFILL_SKIPPED = "prefill_skipped"
    PREFILL_FAILED = "prefill_failed"
    PREFILL_NO_HANDLE = "prefill_no_handle"
    PULL_TIMEOUT = "pull_timeout"
    PULL_DEADLINE = "pull_deadline"
    PULL_SHORT = "pull_short"  # prefill's recompute policy took over: the pull failed
    PULL_FROM_DRAINING = "pull_from_draining"  # the history's decode replica is stopping, not dead
    MOVE_WAITED = "move_waited"  # the turn waited for its conversation's move to another replica
    # The decode leg.
    DECODE_RETRIED = "decode_retried"
    DECODE_RESTARTED = "decode_restarted"
    DECODE_FAILED = "decode_failed"
    DECODE_NO_HANDLE = "decode_no_handle"
    # A streamed answer whose decode replica failed after output reached the client
    # (`app.turn.legs.Legs.decode`): continued on another replica, by how (`Continuation`).
    DECODE_CONTINUED = "decode_continued"
    DECODE_CONTINUED_RESUMED = "decode_continued_resumed"
    DECODE_CONTINUED_REPLAYED_GRAMMAR = "decode_continued_replayed_grammar"
    DECODE_CONTINUED_REPLAYED_OUTPUT = "decode_continued_replayed_output"
    DECODE_CONTINUED_TOKENS = "decode_continued_tokens"  # answer tokens computed again as prompt
    DECODE_REPLAYED_TOKENS = "decode_replayed_tokens"  # answer tokens generated again and dropped
    DECODE_CONTINUATION_DIVERGED = "decode_continuation_diverged"  # a replay gave other tokens
    DECODE_CONTINUATIONS_EXHAUSTED = "decode_continuations_exhausted"  # past `ingress.max_continuations`
    # Decode memory (`app.fleet.memory`).
    CAPACITY_UNKNOWN = "capacity_unknown"
    CAPACITY_SYNCED = "capacity_synced"
    CAPACITY_SYNC_ERROR = "capacity_sync_error"
    MEMORY_TICK_ERROR = "memory_tick_error"
    RELEASED_REQUESTS = "released_requests"
    RELEASED_BLOCKS = "released_blocks"
    RELEASE_NOT_PINNED = "release_not_pinned"
    RELEASE_REPLICA_GONE = "release_replica_gone"
    RELEASE_STORE_ERROR = "release_store_error"
    RELEASE_ENGINE_ERROR = "release_engine_error"
    # Rebalancing (`app.fleet.drain.Rebalance`): conversations moved off a nearly full replica.
    REBALANCE_MOVED = "rebalance_moved"
    REBALANCE_MOVED_BLOCKS = "rebalance_moved_blocks"
    REBALANCE_PULLED_TOKENS = "rebalance_pulled_tokens"
    REBALANCE_RECOMPUTED = "rebalance_recomputed"
    REBALANCE_SUPERSEDED = "rebalance_superseded"
    REBALANCE_FAILED = "rebalance_failed"
    REBALANCE_LATE = "rebalance_late"
    REBALANCE_STORE_ERROR = "rebalance_store_error"
    REBALANCE_ERROR = "rebalance_error"  # a round failed as a whole
    # Releases taken from the store, by the reason the handle left it.
    RELEASE_UNUSED = "release_unused"
    RELEASE_FAILED = "release_failed"
    RELEASE_EXPIRED = "release_expired"
    RELEASE_EVICTED = "release_evicted"
    RELEASE_SUPERSEDED = "release_superseded"
    RELEASE_ENDED = "release_ended"
    # Responses not kept for `previous_response_id` (`app.api.response_chain`), by why.
    RESPONSES_NOT_STORED_TOO_BIG = "responses_not_stored_too_big"
    RESPONSES_NOT_STORED_NO_PARENT = "responses_not_stored_no_parent"
    RESPONSES_NOT_STORED_UNAVAILABLE = "responses_not_stored_unavailable"

    @classmethod
    def not_stored(cls, result: str) -> TurnCount:
        """The counter of a response the store did not keep (`put_response`'s answer)."""
        return cls(f"responses_not_stored_{result}")

    @classmethod
    def release(cls, reason: object) -> TurnCount:
        """The counter of a release taken for `reason` (a `HandleState`, or its value)."""
        return cls(f"release_{getattr(reason, 'value', reason)}")


# Every reason the store can give has its pipeline counterpart (checked at import).
_UNRELEASED = {
    HandleState.STORED,
    HandleState.CLAIMED,
    HandleState.PULLED,
    HandleState.DROPPED,
    HandleState.NO_HANDLE,
}
if not {f"placed_{r.value}" for r in Placed} <= {c.value for c in TurnCount}:
    raise RuntimeError("a placement reason has no TurnCount")
if not {m.value for m in Miss} <= {m.value for m in MissReason}:
    raise RuntimeError("a store miss reason has no MissReason")
if not {f"release_{s.value}" for s in HandleState if s not in _UNRELEASED} <= {c.value for c in TurnCount}:
    raise RuntimeError("a release reason has no TurnCount")
