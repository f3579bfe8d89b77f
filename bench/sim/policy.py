"""The app's own decisions, driven by simulated time: placement (which turns skip
prefill), the pacing it rests on, and the handle store with its pinned-KV budget.

Nothing here re-implements them. `PlacementState.place` is the one seam for the
placement policy: it calls `app.turn.placement.place` (or `place_static`, as
`transfer.placement` says) with the loads the simulation measured. `PlacementState`
holds the app's `LegPace` objects (one for the prefill pool, one per decode replica) and
its `DecodeStreams`, and updates them as `app.turn.legs`, `app.turn.pacing.LocalLeg` and
`DecodeStreams.stream` do, with the simulation's clock in place of `time.monotonic` and
the engines' step times as the gaps between a stream's outputs. `make_store` builds
`connector.store.HandleStore` with the app's session defaults and the simulation's clock.

The app's modules are imported as they are: `app.config` and `app.turn` import neither
Ray nor vLLM (`import app` builds nothing until `app.graph` is asked for).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from app import config
from app.turn import pacing, placement
from app.turn.replicas import hosting_replica, least_loaded
from bench.sim.costs import Jitter
from connector.handle import KVHandle, Location
from connector.store import Conversation, HandleStore


def transfer_config(**changes: Any) -> Any:
    """The app's `TransferConfig`: its defaults, with `changes` (bidir-pd: both
    `decode_local_*` thresholds 0; `placement: static`, the rule the CPU fleet study ran)."""
    return config.TransferConfig(backend="UCX", **changes)


class PlacementState:
    """What the ingress measures for placement (`app.turn.turns.Turns` keeps the same, one
    ingress replica), in the app's own objects: the prefill pool's `LegPace`, each decode
    replica's `LegPace` of the turns it computes alone, and a `DecodeStreams` (per replica
    its streams, their seconds per output and the outputs that came past the ITL target;
    the hand-off of P/D turns). The engines report their outputs' gaps (`outputs`)."""

    LATE_WINDOW = 2000
    """Outputs `pacing.LateTokens` remembers (the app's default window)."""

    def __init__(self, clock: Callable[[], float], transfer: Any, decode_chunk: int, jitter: Jitter = ()):
        self._clock = clock
        self._ratios = [ratio for ratio, _ in jitter]
        self._shares = [share for _, share in jitter]
        """The serving path's jitter (`Hardware.itl_jitter`): each output's gap, as the
        ingress sees it, is its step times a ratio drawn from it (its own seeded draws);
        none: the step itself."""
        self._jitter_rng = random.Random(1)
        self.transfer = transfer
        self.decode_chunk = decode_chunk
        self.prefill = pacing.LegPace()
        self.local: dict[str, pacing.LegPace] = {}
        self.streams = pacing.DecodeStreams(transfer.itl_target_ms / 1000, transfer.itl_late_fraction)
        self._rng = random.Random(0)
        self.placed: Counter[str] = Counter()
        """Every decision by its reason, as the app counts `placed_<reason>`."""

    @property
    def handoff(self) -> pacing.Ewma:
        return self.streams.handoff

    def local_pace(self, replica: str) -> pacing.LegPace:
        if replica not in self.local:
            self.local[replica] = pacing.LegPace()
        return self.local[replica]

    def outputs(self, replica: str, steps: Sequence[float], count: int) -> None:
        """In each of `steps` (engine steps, their seconds), `count` streams on `replica`
        got an output that long after their previous one, as `DecodeStreams.stream`
        observes each chunk."""
        streams = self.streams.of(replica)
        pace, late = streams.seconds_per_token, streams.late
        outputs = min(count, self.LATE_WINDOW)
        if not self._ratios:
            pace.observe_many(steps, outputs)
            late.observe_many(steps, outputs)
            return
        for gap_s in steps:
            ratios = self._jitter_rng.choices(self._ratios, self._shares, k=outputs)
            for gap in [gap_s * r for r in ratios]:
                pace.observe(gap)
                late.observe(gap)

    def least_loaded(self, replicas: list[str]) -> str | None:
        """`Turns._least_loaded_decode`: the replica with the fewest streams, then prompt
        tokens in flight (at random among equals, seeded)."""
        return least_loaded(replicas, self.streams, self.local, self._rng.choice)

    def place(self, new_tokens: int, replica: str | None, context: int = 0) -> str | None:
        """Why the turn skips prefill, or None: the app's decision (the one seam), from
        the loads as `Turns._placement_of` reads them (`context`: the history its decode
        replica holds)."""
        t = self.transfer
        limits = placement.Limits(
            t.decode_local_tokens, t.decode_local_busy_tokens, t.itl_target_ms / 1000, self.decode_chunk
        )
        local, streams = (self.local_pace(replica), self.streams.of(replica)) if replica else (None, None)
        prefill, decode = pacing.loads(self.prefill, self.handoff, local, streams, self._clock())
        policy = placement.place if t.placement == "priced" else placement.place_static
        decided = policy(new_tokens, prefill, decode, limits, context)
        self.placed[str(decided.reason)] += 1
        return str(decided.reason) if decided.local else None

    def place_hosted(self, new_tokens: int, replica: str, context: int = 0) -> str | None:
        """`place` for a session a prefill replica hosts (`Turns._place_hosted`): "hosted",
        or None (through prefill, to decode)."""
        t = self.transfer
        limits = placement.Limits(
            t.decode_local_tokens, t.decode_local_busy_tokens, t.itl_target_ms / 1000, self.decode_chunk
        )
        pool, load = pacing.loads(
            self.prefill, self.handoff, self.local_pace(replica), self.streams.of(replica), self._clock()
        )
        assert load is not None
        legs = self.prefill.tokens_in_flight
        decided = placement.place_hosted(new_tokens, load, limits, context, pool.seconds_per_token, legs)
        self.placed[str(decided.reason)] += 1
        return str(decided.reason) if decided.local else None

    def hosting(self, prefill: Sequence[str], decode: Sequence[str]) -> str | None:
        """The prefill replica that hosts a new session, or None (`app.turn.replicas.hosting_replica`)."""
        legs = self.prefill.tokens_in_flight
        return hosting_replica(
            prefill, decode, self.streams, self.local, legs, self._clock(), self._rng.choice
        )

    def prefill_leg(self, new_tokens: int, context: int = 0) -> Callable[[int], None]:
        """A prefill leg over `context` cached tokens starts (`app.turn.legs.Legs._paced_prefill`);
        call what it returns with the tokens computed when the leg ends."""
        pace, started = self.prefill, self._clock()
        ahead = pace.tokens_in_flight
        pace.tokens_in_flight += new_tokens

        def end(computed: int) -> None:
            pace.tokens_in_flight -= new_tokens
            pace.observe(computed, self._clock() - started, ahead, context)

        return end

    def local_leg(
        self, replica: str, new_tokens: int, context: int = 0
    ) -> Callable[[], Callable[[int], None]]:
        """A turn its decode replica computes alone over `context` cached tokens
        (`app.turn.pacing.LocalLeg`): call what it returns at the first token, then what
        that returns with the tokens computed."""
        pace, started = self.local_pace(replica), self._clock()
        tokens, ahead = max(0, new_tokens), pace.tokens_in_flight
        pace.tokens_in_flight += tokens

        def first() -> Callable[[int], None]:
            to_first = self._clock() - started
            pace.tokens_in_flight -= tokens
            return lambda computed: pace.observe(computed, to_first, ahead, context)

        return first


def make_store(
    clock: Callable[[], float], block_size: int, pinned_fraction: float | None = None
) -> HandleStore:
    """The handle store as the app builds it from its default config (`app.fleet.clients.store_settings`)."""
    s = config.SessionConfig()
    t = transfer_config()
    return HandleStore(
        handle_ttl_s=s.handle_ttl_s,
        decoder_ttl_s=t.decoder_kv_blocks_ttl_s,
        max_sessions=s.max_sessions,
        max_blocks_per_engine=s.max_pinned_blocks_per_engine,
        index_block_size=block_size,
        pinned_fraction=s.pinned_fraction if pinned_fraction is None else pinned_fraction,
        max_store_bytes=s.max_store_bytes,
        clock=clock,
    )


def conversation(session_id: str, turn: int, engine_id: str, tokens: int, block_size: int) -> Conversation:
    """What a turn leaves in the store: a handle to `tokens` positions pinned on
    `engine_id`. The store keeps ids only to match sessionless prompts, which the
    simulation does not send: a stand-in of one id per turn keeps it cheap, while the
    handle carries the real block count the pinned budget counts."""
    n = -(-tokens // block_size)
    handle = KVHandle(
        location=Location.DECODE,
        engine_id=engine_id,
        request_id=f"{session_id}/{turn}",
        block_ids=(tuple(range(n)),),
        host="sim",
        port=0,
        num_tokens=tokens,
    )
    ids = list(range(turn + 2))
    return Conversation(session_id, ids, len(ids) - 1, None, handle, engine_id)
