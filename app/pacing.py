"""Leg pacing: how long legs take on each pool of engines, and where a turn's first token
comes sooner.

`Turns` (one per ingress replica) keeps one `LegPace` for the prefill pool and one per
decode replica for the turns it computes alone (`LocalLeg`). The pace gives a leg that
pulls history a deadline that covers its compute, and `decode_local_reason` decides
whether a turn skips prefill. Everything here is this ingress's view: with several
ingress replicas each counts only the legs it sent. Pure logic, no I/O.
"""

from __future__ import annotations

import time
from typing import Literal

from app.config import TransferConfig


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

    def observe(self, computed_tokens: int, seconds: float, ahead_tokens: int = 0) -> None:
        """A leg computed `computed_tokens` in `seconds`, after `ahead_tokens` of legs
        that were in flight when it started."""
        if computed_tokens < self.MIN_TOKENS or seconds <= 0:
            return
        pace = seconds / (computed_tokens + max(0, ahead_tokens))
        old = self.seconds_per_token
        self.seconds_per_token = pace if old is None else old + self._weight * (pace - old)

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


class LocalLeg:
    """A turn its decode replica computes alone, in that replica's `LegPace`: its tokens
    are in flight until its first token, and a finished turn updates the pace."""

    def __init__(self, pace: LegPace, new_tokens: int):
        self._pace = pace
        self._tokens = max(0, new_tokens)
        self._ahead = pace.tokens_in_flight
        self._started = time.monotonic()
        self._to_first: float | None = None
        pace.tokens_in_flight += self._tokens

    def first_token(self) -> None:
        if self._to_first is None:
            self._to_first = time.monotonic() - self._started
            self._pace.tokens_in_flight -= self._tokens

    def end(self, computed_tokens: int | None) -> None:
        """Called once, however the turn ended; `computed_tokens` None: it failed."""
        if self._to_first is None:
            self._to_first = -1.0
            self._pace.tokens_in_flight -= self._tokens
        elif computed_tokens is not None:
            self._pace.observe(computed_tokens, self._to_first, self._ahead)


def decode_local_reason(
    transfer: TransferConfig, new_tokens: int, prefill: LegPace, local: LegPace | None
) -> Literal["short", "busy"] | None:
    """Why a turn that computes `new_tokens` past the history its decode replica holds
    goes to that replica alone, or None (it goes through prefill). `local`: that
    replica's pace (None: the session has no replica yet).

    * "short": few tokens to compute (`transfer.decode_local_tokens`): a P/D leg would
      cost more than it saves.
    * "busy": prefill has legs in flight and the turn (at most
      `transfer.decode_local_busy_tokens` to compute) would get its first token sooner
      from its decode replica: the prefill legs ahead plus its own tokens, at the prefill
      pool's pace, take longer than the turns that replica is computing alone plus its
      own, at its pace (the prefill pool's until it has one).
    """
    if new_tokens <= transfer.decode_local_tokens:
        return "short"
    if new_tokens > transfer.decode_local_busy_tokens or local is None or prefill.tokens_in_flight <= 0:
        return None
    on_prefill = prefill.expected(new_tokens)
    on_decode = local.expected(new_tokens, prefill.seconds_per_token)
    return "busy" if on_decode < on_prefill else None
