"""Where a bidir turn's new tokens are computed: on the session's decode replica alone
("decode-local": no prefill leg, no transfer) or through prefill (pull the history,
compute, hand the KV to decode).

`Turns._decode_local` calls `place` (or `place_static`, the older rule) once per turn
that could run on its decode replica, with the loads this ingress measured
(`app.turn.pacing`): plain numbers, so a simulator can drive it with simulated time. Pure
logic: no clock, no I/O, no Ray or vLLM.

The priced rule (`place`) weighs both sides of a turn computing `n` new tokens:

* its first token: via prefill in `f + p * (P + n) + q * n * c + h` (prefill's fixed cost
  `f`, seconds per token `p` and per token of context `q`, the tokens of prefill legs in
  flight `P`, the turn's history `c`, the hand-off `h`: decode's read of the blocks to its
  first output); via decode in `g + d * (D + n) + e * n * c + ceil((D + n) / C) * s` (the
  replica's own costs `g`, `d`, `e` computing prompts, the tokens of decode-local turns
  in flight there `D`, its prompt budget per step `C`, and one step of its streams `s` per
  chunk while it has any). The costs per token of context (`app.turn.pacing.LegCost`)
  keep a first turn from being priced at the pace of turns over long histories;
* its streams: each step that computes a chunk of the prompt takes `s + (d + e * c) *
  min(D + n, C)`. A step past the ITL target makes each stream's next output late, once per chunk:
  the streams there now, and those that will start while it computes (at the rate streams
  lately started there beside others), for half its chunks on average.
  The target is a quantile (p99), so a share of the outputs may be late
  (`transfer.itl_late_fraction`): the replica's recent outputs give a budget
  (`app.turn.pacing.LateTokens`), and a turn whose late outputs exceed it goes through
  prefill, as does every turn while the streams there are late beyond their share.

Decode-local when the turn is short (at most `short_tokens`) or comes sooner, and the
streams can afford it; otherwise prefill. Until the replica's own pace is measured,
prefill's stands in for it and the hand-off is not counted as a saving: only a queue on
prefill can make decode sooner.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Reason(enum.StrEnum):
    """Why a turn went where it went (counted as `placed_<reason>`, `app.turn.events.TurnCount`)."""

    SHORT = "short"
    """Decode: few tokens to compute; a P/D leg would cost more than it saves."""
    SOONER = "sooner"
    """Decode: its first token comes sooner there, and its streams stay within target."""
    BUSY = "busy"
    """Decode (the static rule): prefill is busy and decode answers sooner."""
    TOO_LONG = "too_long"
    """Prefill: more tokens than decode is ever given."""
    ITL = "itl"
    """Prefill: its streams would get more late outputs than their budget (past the ITL target)."""
    LATER = "later"
    """Prefill: its first token comes no later through prefill (or nothing is measured)."""
    IDLE = "idle"
    """Prefill (the static rule): prefill has no leg in flight."""
    NO_REPLICA = "no_replica"
    """Prefill: the session has no decode replica yet whose load could be priced."""
    HOSTED = "hosted"
    """A prefill replica that hosts the session computes and streams it (`place_hosted`)."""


ON_DECODE = frozenset({Reason.SHORT, Reason.SOONER, Reason.BUSY, Reason.HOSTED})
"""The reasons that send a turn to its decode replica; the others send it through prefill."""


@dataclass(frozen=True)
class Limits:
    """The policy's settings (from `TransferConfig`)."""

    short_tokens: int
    """Turns computing at most this many tokens go to decode whenever its streams allow."""
    max_tokens: int
    """Longer turns up to this many tokens go to decode only when priced sooner."""
    itl_target_s: float
    """The streams' inter-token latency target (seconds)."""
    chunk_tokens: int = 0
    """Prompt tokens a decode engine computes per step; 0: a whole prompt in one step."""


@dataclass(frozen=True)
class PrefillLoad:
    """The prefill pool as this ingress sees it."""

    seconds_per_token: float | None
    """Seconds per computed prompt token, queueing behind legs included; None: unmeasured."""
    tokens_in_flight: int = 0
    """New tokens of the prefill legs in flight."""
    handoff_s: float | None = None
    """Seconds from a P/D turn's decode call to its first output; None: unmeasured."""
    fixed_s: float = 0.0
    """Seconds a leg takes beyond its tokens' (`app.turn.pacing.LegPace.cost`)."""
    seconds_per_context: float = 0.0
    """Seconds per computed token per token of history it attends over."""


@dataclass(frozen=True)
class DecodeLoad:
    """One decode replica as this ingress sees it."""

    seconds_per_token: float | None
    """Seconds per prompt token of the turns it computes alone; None: unmeasured."""
    tokens_in_flight: int = 0
    """New tokens of decode-local turns in flight there, before their first token."""
    streams: int = 0
    """Answers it is streaming (past their first token)."""
    seconds_per_step: float | None = None
    """Seconds per generated token of those streams lately (its step time); None: unmeasured."""
    fixed_s: float = 0.0
    """Seconds a decode-local turn takes to its first token beyond its tokens'."""
    late_budget: int = 0
    """Outputs of its streams that may still come past the ITL target (`LateTokens.budget`)."""
    seconds_per_context: float = 0.0
    """Seconds per computed token per token of history it attends over."""
    joined_per_s: float = 0.0
    """Streams that started there beside others lately, per second: those that will start
    while a turn computes (`app.turn.pacing.ReplicaStreams.joined_per_s`)."""


@dataclass(frozen=True)
class Placement:
    """The decision, with the estimates behind it (seconds; None where not priced)."""

    local: bool
    reason: Reason
    decode_s: float | None = None
    prefill_s: float | None = None
    stream_step_s: float | None = None
    """A stream's step on decode while it computes a chunk of the turn."""
    late_outputs: int = 0
    """Outputs of the streams there the turn is expected to make late, when it goes there."""


def place(
    new_tokens: int, prefill: PrefillLoad, decode: DecodeLoad | None, limits: Limits, context: int = 0
) -> Placement:
    """The priced rule: where a turn computing `new_tokens` (past the `context` tokens of
    history its decode replica holds) goes. `decode`: the session's decode replica (None:
    it has none yet; then only the short rule applies)."""
    if new_tokens > max(limits.short_tokens, limits.max_tokens):
        return Placement(False, Reason.TOO_LONG)
    if decode is None:
        short = new_tokens <= limits.short_tokens
        return Placement(short, Reason.SHORT if short else Reason.NO_REPLICA)
    measured = decode.seconds_per_token is not None
    per_context = decode.seconds_per_context if measured else prefill.seconds_per_context
    pace = decode.seconds_per_token if measured else prefill.seconds_per_token
    fixed = decode.fixed_s if measured else prefill.fixed_s
    tokens = decode.tokens_in_flight + new_tokens
    steps = math.ceil(tokens / limits.chunk_tokens) if limits.chunk_tokens > 0 else 1
    step = decode.seconds_per_step or 0.0
    stream_step, late, over = _streams_cost(new_tokens, pace, per_context, decode, limits, context)
    if over:
        return Placement(False, Reason.ITL, stream_step_s=stream_step, late_outputs=late)
    if new_tokens <= limits.short_tokens:
        return Placement(True, Reason.SHORT, stream_step_s=stream_step, late_outputs=late)
    if prefill.seconds_per_token is None or pace is None:
        return Placement(False, Reason.LATER)
    handoff = prefill.handoff_s or 0.0
    queued = prefill.tokens_in_flight + new_tokens
    attend = prefill.seconds_per_context * new_tokens * context
    on_prefill = prefill.fixed_s + prefill.seconds_per_token * queued + attend + handoff
    on_decode = fixed + pace * tokens + per_context * new_tokens * context
    on_decode += steps * step if decode.streams > 0 else 0.0
    if not measured:
        on_decode += handoff  # an unmeasured replica: only prefill's queue is a saving
    sooner = on_decode < on_prefill
    reason = Reason.SOONER if sooner else Reason.LATER
    return Placement(sooner, reason, on_decode, on_prefill, stream_step, late)


def place_hosted(
    new_tokens: int,
    host: DecodeLoad,
    limits: Limits,
    context: int = 0,
    pace: float | None = None,
    legs_in_flight: int = 0,
) -> Placement:
    """Where a turn of a session a prefill replica hosts goes: computed and streamed there
    (`Reason.HOSTED`), unless the streams it hosted came late beyond their share
    or prefill legs are in flight (`Reason.ITL`: the regime rule, prefill is needed for
    legs), or the turn is longer than decode is ever given (`Reason.TOO_LONG`);
    then through prefill as any P/D turn (the leg runs on that replica over the history it
    caches, and decode takes the session over). The turn's own stall is not a reason to
    leave: its leg would run on the same engine and stall the same streams, and its first
    token would come later (a hand-off follows). What it is expected to make late is still
    priced (`late_outputs`, reserved from the budget until its first token). `pace`:
    seconds per prompt token there while `host` has none measured (the prefill pool's)."""
    if new_tokens > max(limits.short_tokens, limits.max_tokens):
        return Placement(False, Reason.TOO_LONG)
    measured = host.seconds_per_token if host.seconds_per_token is not None else pace
    stream_step, late, _ = _streams_cost(
        new_tokens, measured, host.seconds_per_context, host, limits, context
    )
    # Prefill legs in flight (the fleet's load has grown past hosting: they would stretch
    # its streams' steps), or its streams late beyond their share: its sessions go to decode.
    stay = host.late_budget >= 0 and legs_in_flight <= 0
    return Placement(
        stay,
        Reason.HOSTED if stay else Reason.ITL,
        stream_step_s=stream_step,
        late_outputs=late if stay else 0,
    )


def _streams_cost(
    new_tokens: int,
    pace: float | None,
    per_context: float,
    replica: DecodeLoad,
    limits: Limits,
    context: int,
) -> tuple[float, int, bool]:
    """What computing `new_tokens` on `replica` costs the streams there: their step while
    it computes a chunk, the outputs it makes late, and whether those are more than the
    replica's late budget (or its streams are already late beyond it)."""
    tokens = replica.tokens_in_flight + new_tokens
    chunk = min(tokens, limits.chunk_tokens) if limits.chunk_tokens > 0 else tokens
    steps = math.ceil(tokens / limits.chunk_tokens) if limits.chunk_tokens > 0 else 1
    stream_step = (replica.seconds_per_step or 0.0) + ((pace or 0.0) + per_context * context) * chunk
    # The streams there now wait on each of its steps; those that start meanwhile, on the
    # steps left (half of them, on average).
    starting = steps * stream_step * replica.joined_per_s
    late = 0
    if replica.streams > 0 or round(starting * steps / 2) > 0:
        if pace is not None and stream_step > limits.itl_target_s:
            late = round((replica.streams + starting / 2) * steps)
        if replica.late_budget < 0 or late > replica.late_budget:
            return stream_step, late, True
    return stream_step, late, False


def place_static(
    new_tokens: int, prefill: PrefillLoad, decode: DecodeLoad | None, limits: Limits, context: int = 0
) -> Placement:
    """The static rule (`transfer.placement: static`), from the turn's own first token
    only: decode when it computes at most `short_tokens`; while prefill has legs in
    flight, also when it computes at most `max_tokens` and the prefill legs ahead plus
    its own tokens take longer at prefill's pace than the replica's decode-local turns
    plus its own at the replica's (prefill's until measured). Streams and the history's
    length (`context`) are not priced."""
    if new_tokens <= limits.short_tokens:
        return Placement(True, Reason.SHORT)
    if new_tokens > limits.max_tokens:
        return Placement(False, Reason.TOO_LONG)
    if decode is None:
        return Placement(False, Reason.NO_REPLICA)
    if prefill.tokens_in_flight <= 0:
        return Placement(False, Reason.IDLE)
    on_prefill = (prefill.seconds_per_token or 0.0) * (prefill.tokens_in_flight + new_tokens)
    pace = decode.seconds_per_token if decode.seconds_per_token is not None else prefill.seconds_per_token
    on_decode = (pace or 0.0) * (decode.tokens_in_flight + new_tokens)
    sooner = on_decode < on_prefill
    return Placement(sooner, Reason.BUSY if sooner else Reason.LATER, on_decode, on_prefill)
