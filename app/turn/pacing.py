"""Leg pacing: how long legs take on each pool of engines, and where a turn's first token
comes sooner.

`Turns` (one per ingress replica) keeps one `LegPace` for the prefill pool and one per
decode replica for the turns it computes alone (`LocalLeg`), and a `DecodeStreams`: per
decode replica the answers streaming there and their pace per token, and the hand-off of
P/D turns (decode's read of prefill's blocks to its first output). The pace gives a leg
that pulls history a deadline that covers its compute; all of it feeds `app.turn.placement`,
which decides whether a turn skips prefill. Everything here is this ingress's view: with
several ingress replicas each counts only the legs and streams it sent. No I/O beyond
passing engine calls through.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from app.engines.wire import EngineChunk, EngineRequest
from app.turn.placement import DecodeLoad, PrefillLoad
from connector.handle import KVHandle, Location, WireError

if TYPE_CHECKING:
    from app.turn.model import EngineClients


class LegCost(NamedTuple):
    """What a leg on one pool costs: `fixed + per_token * tokens + per_context * new *
    context` seconds, for `tokens` to compute (its own and those of the legs ahead of it),
    `new` of its own over `context` tokens already cached (attention reads the history for
    every new token: a turn over a long history costs more per token than a first turn)."""

    fixed: float
    per_token: float | None
    per_context: float = 0.0


class LegPace:
    """How long legs take on one pool of engines, to give a leg that pulls history a
    deadline that covers its compute (`pull_timeout_s` bounds what the pull adds, not the
    whole leg) and to tell where a turn's first token comes sooner.

    Tracks seconds per prompt token the pool computes (a moving average over this
    ingress's legs: a leg's time over its own tokens plus those of the legs that were in
    flight when it started, since it waited for them) and the tokens that legs in flight
    will compute. Counting the legs ahead in the pace keeps queueing from being counted
    twice under load (once in the pace, again in the tokens ahead). One instance for the
    prefill pool, one per decode replica for the turns it computes alone."""

    MIN_TOKENS = 64
    """Legs computing fewer tokens are mostly fixed cost; they don't update the pace."""

    def __init__(self, weight: float = 0.3):
        self._weight = weight
        self.seconds_per_token: float | None = None
        self.tokens_in_flight = 0
        self.line = LineFit()
        """The same legs as a fixed cost, a cost per token and one per token of context
        (`cost`), for placement."""

    def observe(
        self, computed_tokens: int, seconds: float, ahead_tokens: int = 0, context_tokens: int = 0
    ) -> None:
        """A leg computed `computed_tokens` over `context_tokens` already cached in
        `seconds`, after `ahead_tokens` of legs that were in flight when it started."""
        if computed_tokens < self.MIN_TOKENS or seconds <= 0:
            return
        tokens = computed_tokens + max(0, ahead_tokens)
        pace = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = pace if old is None else old + self._weight * (pace - old)
        self.line.observe(tokens, seconds, computed_tokens * max(0, context_tokens))

    def cost(self) -> LegCost:
        """A leg's `LegCost`: the fit through the legs measured once they spread enough to
        tell the terms apart, else (0, `seconds_per_token`, 0). A pool that computes mostly
        short legs has a pace per token inflated by their fixed cost; the fit keeps that
        from pricing its long legs too high, and its context term from pricing a first
        turn (no history) at the pace of turns over long ones."""
        fit = self.line.fit()
        return fit if fit is not None else LegCost(0.0, self.seconds_per_token)

    def deadline(self, new_tokens: int, base_s: float) -> float:
        """Seconds a leg computing `new_tokens` (started now) may take: `base_s` plus
        twice the expected compute of it and of the legs ahead of it."""
        if self.seconds_per_token is None:
            return base_s
        return base_s + 2.0 * self.seconds_per_token * (self.tokens_in_flight + new_tokens)

    def expected(self, new_tokens: int, seconds_per_token: float | None = None) -> float:
        """Seconds a leg computing `new_tokens` (started now) is expected to take, the
        legs ahead of it included (0 until a leg was measured; `seconds_per_token`
        stands in for the pace until then)."""
        pace = self.seconds_per_token if self.seconds_per_token is not None else seconds_per_token
        return (pace or 0.0) * (self.tokens_in_flight + new_tokens)


class LineFit:
    """`seconds = fixed + per_token * tokens + per_context * work`, fitted to legs as they
    end (`work`: a leg's new tokens times the context they attend over): moving averages
    of the terms and their products, so that old legs fade as the load changes. Where the
    legs do not spread enough in `work` to tell its term apart (all over one context, or
    work in step with tokens), the line through `tokens` alone."""

    MIN_LEGS = 8
    SPREAD = 0.25
    """A term must spread by this share of its mean before it is fitted."""
    MAX_CORRELATION = 0.95
    """Tokens and work this correlated (r^2) cannot be told apart: the line alone."""

    def __init__(self, weight: float = 0.1):
        self._weight = weight
        self._legs = 0
        self._x = self._w = self._y = 0.0
        self._xx = self._ww = self._xw = self._xy = self._wy = 0.0

    def observe(self, tokens: float, seconds: float, work: float = 0.0) -> None:
        a = 1.0 if self._legs == 0 else self._weight
        self._legs += 1
        self._x += a * (tokens - self._x)
        self._w += a * (work - self._w)
        self._y += a * (seconds - self._y)
        self._xx += a * (tokens * tokens - self._xx)
        self._ww += a * (work * work - self._ww)
        self._xw += a * (tokens * work - self._xw)
        self._xy += a * (tokens * seconds - self._xy)
        self._wy += a * (work * seconds - self._wy)

    def fit(self) -> LegCost | None:
        """The cost, or None: too few legs, too little spread in tokens, or no fit with
        positive costs per token, a context cost and a fixed cost of at least 0."""
        var_x = self._xx - self._x * self._x
        if self._legs < self.MIN_LEGS or var_x <= (self.SPREAD * self._x) ** 2:
            return None
        cov_xy = self._xy - self._x * self._y
        var_w = self._ww - self._w * self._w
        cov_xw = self._xw - self._x * self._w
        det = var_x * var_w - cov_xw * cov_xw
        if var_w > (self.SPREAD * self._w) ** 2 and det > (1 - self.MAX_CORRELATION) * var_x * var_w:
            cov_wy = self._wy - self._w * self._y
            per_token = (cov_xy * var_w - cov_wy * cov_xw) / det
            per_context = (cov_wy * var_x - cov_xy * cov_xw) / det
            fixed = self._y - per_token * self._x - per_context * self._w
            if per_token > 0 and per_context >= 0 and fixed >= 0:
                return LegCost(fixed, per_token, per_context)
        per_token = cov_xy / var_x
        fixed = self._y - per_token * self._x
        if per_token <= 0 or fixed < 0:
            return None
        return LegCost(fixed, per_token)


class LocalLeg:
    """A turn its decode replica computes alone, in that replica's `LegPace`: its tokens
    are in flight until its first token, and a finished turn updates the pace. The late
    outputs its placement expects of the replica's streams (`late_outputs`) are reserved
    in their `LateTokens` until then, when they have come and been counted."""

    def __init__(
        self,
        pace: LegPace,
        new_tokens: int,
        late: LateTokens | None = None,
        late_outputs: int = 0,
        context_tokens: int = 0,
    ):
        self._pace = pace
        self._tokens = max(0, new_tokens)
        self._context = max(0, context_tokens)
        self._ahead = pace.tokens_in_flight
        self._started = time.monotonic()
        self._to_first: float | None = None
        self._late, self._reserved = late, max(0, late_outputs) if late is not None else 0
        pace.tokens_in_flight += self._tokens
        if self._late is not None:
            self._late.reserved += self._reserved

    def first_token(self) -> None:
        if self._to_first is None:
            self._to_first = time.monotonic() - self._started
            self._computed()

    def end(self, computed_tokens: int | None) -> None:
        """Called once, however the turn ended; `computed_tokens` None: it failed."""
        if self._to_first is None:
            self._to_first = -1.0
            self._computed()
        elif computed_tokens is not None:
            self._pace.observe(computed_tokens, self._to_first, self._ahead, self._context)

    def _computed(self) -> None:
        self._pace.tokens_in_flight -= self._tokens
        if self._late is not None:
            self._late.reserved -= self._reserved


class Ewma:
    """A moving average of observations (None until the first)."""

    def __init__(self, weight: float = 0.2):
        self._weight = weight
        self.value: float | None = None

    def observe(self, value: float) -> None:
        old = self.value
        self.value = value if old is None else old + self._weight * (value - old)

    def observe_many(self, values: Iterable[float], count: int) -> None:
        """`observe(value)` `count` times for each of `values`, in order (the same result,
        to the last bit)."""
        if count <= 0:
            return
        x, w = self.value, self._weight
        for value in values:
            n = count
            if x is None:
                x, n = value, n - 1
            for _ in range(n):
                if x == value:
                    break
                x = x + w * (value - x)
        self.value = x


class LateTokens:
    """Of the last `window` outputs streamed from one decode replica (a token, or the
    tokens of one step), those that came later than the ITL target after the previous
    one; and how many more may (`budget`). The target is a quantile (p99), so a
    `fraction` of a window's outputs may be late: placement spends that on decode-local
    turns that stretch the streams' steps, and stops when the streams come late on their
    own. The budget grows with the outputs seen: a replica earns its share before it
    spends it (a window's budget up front, spent at once, can miss a p99 taken over fewer
    outputs than a window)."""

    def __init__(self, target_s: float, fraction: float, window: int = 2000):
        self.target_s = target_s
        self.fraction = fraction
        self._late: deque[bool] = deque(maxlen=window)
        self.late = 0
        self.reserved = 0
        """Late outputs expected of decode-local turns placed but not yet at their first
        token (their chunks still to stretch the steps): spent, not yet seen."""

    MARGIN = 0.8
    """An output counts as late past this share of the target: the ingress sees it a
    little before the client does (the HTTP stream's own jitter is still to come)."""

    def observe(self, gap_s: float) -> None:
        """An output came `gap_s` after the previous one."""
        late = gap_s > self.MARGIN * self.target_s
        if len(self._late) == self._late.maxlen:
            self.late -= self._late[0]
        self._late.append(late)
        self.late += late

    def observe_many(self, gaps: Iterable[float], count: int) -> None:
        """In each of `gaps` (engine steps), `count` outputs came that long after their
        previous ones: `observe(gap)` `count` times for each, in order."""
        if count <= 0:
            return
        limit = self.MARGIN * self.target_s
        for late, run in itertools.groupby(gap > limit for gap in gaps):
            self._extend(late, sum(1 for _ in run) * count)

    def _extend(self, late: bool, count: int) -> None:
        window = self._late.maxlen or 0
        count = min(count, window)
        dropped = len(self._late) + count - window
        if dropped > 0:
            self.late -= sum(itertools.islice(self._late, dropped))
        self._late.extend(itertools.repeat(late, count))
        self.late += late * count

    @property
    def seen(self) -> int:
        return len(self._late)

    @property
    def budget(self) -> int:
        """Outputs that may still come late (negative: more came late than may)."""
        return math.floor(self.fraction * len(self._late)) - self.late - self.reserved


JOINED_WINDOW_S = 10.0
"""The window over which `ReplicaStreams.joined_per_s` counts starts."""


class ReplicaStreams:
    """The answers this ingress has streaming on one decode replica (counted from their
    first output to their end), the seconds per token they get lately (the replica's step
    time under its running batch, as its streams see it) and those that came late."""

    def __init__(self, itl_target_s: float = 0.05, late_fraction: float = 0.005) -> None:
        self.streams = 0
        self.seconds_per_token = Ewma()
        self.late = LateTokens(itl_target_s, late_fraction)
        self.last_end: float | None = None
        """When (monotonic seconds) its last stream ended."""
        self._joined: deque[float] = deque()
        """When streams started there that joined others already streaming (monotonic
        seconds, the last `JOINED_WINDOW_S`)."""

    def idle_for(self, now: float) -> float:
        """Seconds since its last stream ended (0 while one streams; inf if none ever did)."""
        if self.streams > 0:
            return 0.0
        return now - self.last_end if self.last_end is not None else math.inf

    def forgive(self) -> None:
        """Start a fresh record of late outputs (an idle replica's old ones no longer say
        what its streams would get now)."""
        self.late = LateTokens(self.late.target_s, self.late.fraction)

    def started(self, now: float) -> None:
        """A stream got its first output at `now` (monotonic seconds)."""
        if self.streams > 0:
            self._joined.append(now)
            self._forget(now)
        self.streams += 1

    def joined_per_s(self, now: float) -> float:
        """Streams that started there beside others, per second over the last
        `JOINED_WINDOW_S`: those expected to start while a prompt takes several steps.
        A start on an idle replica is not counted, so one client's turns sent one after
        another (each the next one's only stream) are never mistaken for them."""
        self._forget(now)
        return len(self._joined) / JOINED_WINDOW_S

    def _forget(self, now: float) -> None:
        """Drop the starts older than the window (here too, not only when read: a replica
        whose turns are never placed must not keep every start)."""
        while self._joined and self._joined[0] < now - JOINED_WINDOW_S:
            self._joined.popleft()


class DecodeStreams:
    """Per decode replica, its `ReplicaStreams`; and the hand-off of P/D turns. Fed by
    every decode call of the ingress's turns (`watch` wraps the engine clients the legs
    use), read by `Turns._decode_local`."""

    def __init__(self, itl_target_s: float = 0.05, late_fraction: float = 0.005) -> None:
        self.replicas: dict[str, ReplicaStreams] = {}
        self.handoff = Ewma()
        """Seconds from a P/D turn's decode call (reading prefill's blocks) to its first output."""
        self._itl = (itl_target_s, late_fraction)

    def of(self, replica: str) -> ReplicaStreams:
        streams = self.replicas.get(replica)
        if streams is None:
            streams = self.replicas[replica] = ReplicaStreams(*self._itl)
        return streams

    def watch(self, clients: EngineClients) -> EngineClients:
        """`clients`, with every decode stream counted here."""
        return cast("EngineClients", _WatchedClients(clients, self))

    async def stream(
        self, request: EngineRequest, chunks: AsyncIterator[tuple[EngineChunk, str]]
    ) -> AsyncIterator[tuple[EngineChunk, str]]:
        """Pass a decode call's chunks through, counting its stream on the replica that
        answers and timing its tokens (and, for a P/D turn, its hand-off)."""
        started = time.monotonic()
        last: float | None = None
        counted: ReplicaStreams | None = None
        try:
            async for chunk, replica in chunks:
                now = time.monotonic()
                if last is None:
                    if replica:
                        counted = self.of(replica)
                        counted.started(now)
                    if _reads_from_prefill(request):
                        self.handoff.observe(now - started)
                    last = now
                elif chunk.token_ids:
                    if counted is not None:
                        counted.seconds_per_token.observe((now - last) / len(chunk.token_ids))
                        counted.late.observe(now - last)
                    last = now
                yield chunk, replica
        finally:
            if counted is not None:
                counted.streams -= 1
                counted.last_end = time.monotonic()


class _WatchedClients:
    """Engine clients whose decode calls go through `DecodeStreams.stream`; everything
    else is the wrapped clients'."""

    def __init__(self, clients: EngineClients, streams: DecodeStreams):
        self._clients = clients
        self._streams = streams

    def decode(self, request: EngineRequest) -> AsyncIterator[tuple[EngineChunk, str]]:
        return self._streams.stream(request, self._clients.decode(request))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clients, name)


def _reads_from_prefill(request: EngineRequest) -> bool:
    try:
        return KVHandle.from_wire(request.kv_params).location is Location.PREFILL
    except WireError:
        return False


def loads(
    prefill: LegPace,
    handoff: Ewma,
    local: LegPace | None,
    streams: ReplicaStreams | None,
    now: float | None = None,
) -> tuple[PrefillLoad, DecodeLoad | None]:
    """What placement reads (`app.turn.placement.place`): the prefill pool's costs, its
    tokens in flight and the hand-off; a decode replica's costs for the turns it computes
    alone, its tokens in flight, its streams, their step and late budget (None: no replica)."""
    cost = prefill.cost()
    pool = PrefillLoad(cost.per_token, prefill.tokens_in_flight, handoff.value, cost.fixed, cost.per_context)
    if local is None or streams is None:
        return pool, None
    cost = local.cost()
    replica = DecodeLoad(
        cost.per_token,
        local.tokens_in_flight,
        streams.streams,
        streams.seconds_per_token.value,
        cost.fixed,
        streams.late.budget,
        cost.per_context,
        streams.joined_per_s(time.monotonic() if now is None else now),
    )
    return pool, replica
