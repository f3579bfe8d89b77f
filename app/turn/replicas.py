"""Which replica takes a new session: the decode replica it is priced on
(`least_loaded`), or a prefill replica that hosts it (`hosting_replica`,
`transfer.prefill_hosts`). From the loads this ingress measured (`app.turn.pacing`);
pure logic, no clock, no I/O, so the simulation drives it with simulated time."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence

from app.turn.pacing import DecodeStreams, LegPace


def least_loaded(
    replicas: Collection[str],
    streams: DecodeStreams,
    paces: Mapping[str, LegPace],
    choice: Callable[[Sequence[str]], str] = random.choice,
) -> str | None:
    """Of `replicas`, one with the fewest streams, then prompt tokens in flight (by
    `choice` among equals); None when there is none. The replica a new session is priced on."""
    if not replicas:
        return None

    def load(replica: str) -> tuple[int, int]:
        pace = paces.get(replica)
        return streams.of(replica).streams, pace.tokens_in_flight if pace else 0

    least = min(load(r) for r in replicas)
    return choice(sorted(r for r in replicas if load(r) == least))


HOST_RETRY_S = 10.0
"""A prefill replica whose hosted streams came late may host again once it has streamed
nothing this long (`hosting_replica`)."""


def hosting_replica(
    prefill: Collection[str],
    decode: Collection[str],
    streams: DecodeStreams,
    paces: Mapping[str, LegPace],
    legs_in_flight: int,
    now: float,
    choice: Callable[[Sequence[str]], str] = random.choice,
) -> str | None:
    """The prefill replica that hosts a new session (`transfer.prefill_hosts`), or None.

    None while prefill legs are in flight (`legs_in_flight`: prefill is needed for legs,
    which would stall the streams it hosts). Else, of the `prefill` replicas whose streams
    are within their late budget and the `decode` replicas, the least loaded (streams,
    then prompt tokens in flight), by `choice` among equals as data parallel engines share
    sessions out; a prefill replica if that one is. A prefill replica whose streams came
    late and that has streamed nothing for `HOST_RETRY_S` starts a fresh record: it may
    host again, and hands the session back if its streams come late."""
    hosts: list[str] = []
    for replica in prefill if legs_in_flight <= 0 else ():  # prefill legs run: no hosting
        record = streams.of(replica)
        if record.late.budget < 0 and record.idle_for(now) >= HOST_RETRY_S:
            record.forgive()
        if record.late.budget >= 0:
            hosts.append(replica)
    if not hosts:
        return None
    chosen = least_loaded(hosts + list(decode), streams, paces, choice)
    return chosen if chosen in hosts else None
