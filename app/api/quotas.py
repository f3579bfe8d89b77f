"""Per-tenant quotas at the ingress: turns in flight and prompt tokens per rolling minute.

One `Quotas` per ingress replica. A fleet-wide limit (`TenantPolicy`) is split evenly
among the ingress replicas (Serve spreads requests over them), so each replica admits
its part; with one ingress replica the limit is exact. A refused turn is answered 429
with `Retry-After` before anything is claimed, pinned or computed: the session's stored
conversation and KV are untouched.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from app.api.auth import Tenant
from app.errors import RateLimited

WINDOW_S = 60.0


class Quotas:
    def __init__(self, ingress_replicas: int = 1, clock: Callable[[], float] = time.monotonic):
        self._replicas = max(1, ingress_replicas)
        self._clock = clock
        self._in_flight: Counter[str] = Counter()
        self._tokens: dict[str, deque[tuple[float, int]]] = {}
        self.refused: Counter[tuple[str, str]] = Counter()
        """(tenant label, quota) -> turns refused."""

    def _part(self, limit: int) -> int:
        return max(1, math.ceil(limit / self._replicas))

    @contextmanager
    def admit(self, tenant: Tenant, prompt_tokens: int) -> Iterator[None]:
        """Hold one of the tenant's turn slots and count its prompt tokens for the turn's
        duration; raises a 429 `APIError` (with `Retry-After`) when a quota is spent."""
        policy, key = tenant.policy, tenant.label
        if policy.max_concurrent_turns is not None and self._in_flight[key] >= self._part(
            policy.max_concurrent_turns
        ):
            self._refuse(key, "concurrent_turns", 1, f"at most {policy.max_concurrent_turns} turns in flight")
        if policy.prompt_tokens_per_minute is not None:
            self._take_tokens(
                key,
                self._part(policy.prompt_tokens_per_minute),
                prompt_tokens,
                policy.prompt_tokens_per_minute,
            )
        self._in_flight[key] += 1
        try:
            yield
        finally:
            self._in_flight[key] -= 1
            if self._in_flight[key] <= 0:
                del self._in_flight[key]

    def _take_tokens(self, key: str, limit: int, tokens: int, fleet_limit: int) -> None:
        now = self._clock()
        window = self._tokens.setdefault(key, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        used = sum(n for _, n in window)
        if window and used + tokens > limit:
            # Room comes back as the oldest turns leave the window.
            freed, wait = 0, WINDOW_S
            for at, n in window:
                freed += n
                if used - freed + tokens <= limit:
                    wait = at + WINDOW_S - now
                    break
            self._refuse(
                key, "prompt_tokens_per_minute", wait, f"at most {fleet_limit} prompt tokens a minute"
            )
        window.append((now, tokens))  # a first turn larger than the limit still runs alone

    def _refuse(self, key: str, quota: str, retry_after_s: float, what: str) -> None:
        self.refused[(key, quota)] += 1
        seconds = max(1, math.ceil(retry_after_s))
        raise RateLimited(f"Rate limit reached for this API key: {what}. Try again in {seconds} s.", seconds)

    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)
