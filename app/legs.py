"""The two engine legs of a turn, with their fallbacks: the prefill leg (pull the history
the claimed handle names, compute the rest, keep the KV for decode; a late or failed pull
recomputes) and the decode leg (stream the answer; a replica that fails before the client
saw output is replaced, up to `DECODE_ATTEMPTS`). Called by `Turns.run` once per turn each
(the prefill leg only on the P/D path); every fallback is counted in the shared counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from app.config import AppConfig
from app.errors import APIError, DecodeFailed
from app.events import TurnCount
from app.pacing import LegPace
from app.turn_model import EngineClients, TurnInput
from app.wire import EngineChunk, EngineRequest, Sampling
from connector.handle import KVHandle, WireError, local_decode_params, prefill_params

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Restart:
    """From `Legs.decode`: the attempt so far failed; another replica starts over."""


DECODE_ATTEMPTS = 3
"""Decode replicas a turn tries before it fails (each after the last failed before output)."""
DECODE_RETRY_PAUSE_S = 0.2
"""Pause before the n-th retry, times n: Serve's routers drop a dead replica within it."""


class Legs:
    """Runs the legs of the turns of one ingress replica (`Turns` owns it)."""

    def __init__(self, cfg: AppConfig, clients: EngineClients, counts: Counter[str], pace: LegPace):
        self._cfg = cfg
        self._clients = clients
        self.counts = counts
        self.pace = pace
        """The prefill pool's pace, shared with `Turns`' routing decisions."""

    async def prefill(
        self,
        turn: TurnInput,
        prompt_ids,
        history: KVHandle | None,
        pin_deadline: float | None = None,
        timings: dict[str, float] | None = None,
    ) -> tuple[dict | None, int, bool]:
        """Run the prefill leg. Returns params for decode (None: decode computes all),
        the prompt tokens prefill did not compute, and whether the offered history was read.
        The engine's own times of the leg that answered go into `timings`.

        A leg that pulls history gets a deadline (`LegPace.deadline`: the pull's
        `transfer.pull_timeout_s` on top of the compute expected here); past it the call
        is cancelled (the server aborts the engine request) and prefill recomputes. The
        deadline never passes `pin_deadline`, when the decode engine's pin ends (counted
        as `pull_deadline` rather than `pull_timeout` when that is what cut it)."""
        request = EngineRequest(
            request_id=turn.request_id + "-prefill",
            prompt_token_ids=prompt_ids,
            sampling=Sampling(max_tokens=1, temperature=0.0),
            kv_params=prefill_params(history),
            cache_salt=turn.cache_salt,
        )
        new_tokens = len(prompt_ids) - (history.num_tokens if history is not None else 0)
        # Every leg has a deadline: a pool with no live replica (all restarting) must not
        # hold the turn; decode can always compute the prompt itself.
        t = self._cfg.transfer
        timeout, by_pin = (
            self.pace.deadline(new_tokens, t.pull_timeout_s if history is not None else t.prefill_timeout_s),
            False,
        )
        if history is not None and pin_deadline is not None and pin_deadline - time.monotonic() < timeout:
            timeout, by_pin = max(0.0, pin_deadline - time.monotonic()), True
        final: EngineChunk | None
        try:
            final = await self._paced_prefill(request, new_tokens, timeout)
        except TimeoutError:
            if history is None:  # nothing to recompute without: decode computes the prompt
                self.counts[TurnCount.PREFILL_TIMEOUT] += 1
                self.counts[TurnCount.PREFILL_SKIPPED] += 1
                return None, 0, False
            self.counts[TurnCount.PULL_DEADLINE if by_pin else TurnCount.PULL_TIMEOUT] += 1
            final = await self._recompute_prefill(request)
            history = None
            pull_ok = False
        except Exception as exc:  # the replica or its engine failed (not a timeout)
            self.counts[TurnCount.PREFILL_FAILED] += 1
            logger.warning("prefill leg %s failed, retrying without history: %r", request.request_id, exc)
            final = await self._recompute_prefill(request)
            pull_ok = False
        else:
            pull_ok = history is None or final.num_cached_tokens + self._cfg.block_size > history.num_tokens
            if not pull_ok:
                # Prefill's recompute policy took over: the pull failed.
                self.counts[TurnCount.PULL_SHORT] += 1
        if final is None:  # prefill failed twice: decode computes the whole prompt
            return None, 0, False
        if timings is not None and final.engine_timings:
            timings["prefill_queue_s"] = final.engine_timings["queue_s"]
            timings["prefill_engine_s"] = final.engine_timings["first_token_s"]
        try:
            return KVHandle.from_wire(final.kv_params).to_wire(), final.num_cached_tokens, pull_ok
        except WireError:
            self.counts[TurnCount.PREFILL_NO_HANDLE] += 1
            return None, final.num_cached_tokens, pull_ok

    async def _recompute_prefill(self, failed: EngineRequest) -> EngineChunk | None:
        """Run a failed or late prefill leg again, without history (Serve's router picks a
        replica, a dead one no longer among them). None if this fails too: the turn then
        goes to decode without transfer params (counted as `prefill_skipped`)."""
        retry = dataclasses.replace(
            failed, request_id=failed.request_id + "-recompute", kv_params=prefill_params(None)
        )
        new_tokens = len(retry.prompt_token_ids)
        try:
            return await self._paced_prefill(
                retry, new_tokens, self.pace.deadline(new_tokens, self._cfg.transfer.prefill_timeout_s)
            )
        except Exception as exc:  # a timeout included
            self.counts[TurnCount.PREFILL_SKIPPED] += 1
            logger.warning("prefill retry %s failed, decode computes the prompt: %r", retry.request_id, exc)
            return None

    async def _paced_prefill(
        self, request: EngineRequest, new_tokens: int, timeout: float | None = None
    ) -> EngineChunk:
        """One prefill call, counted in the pace: its `new_tokens` are in flight while it
        runs, and a call that finishes updates the seconds per computed token."""
        ahead = self.pace.tokens_in_flight
        self.pace.tokens_in_flight += new_tokens
        started = time.monotonic()
        try:
            final, _ = await asyncio.wait_for(self._clients.prefill(request), timeout)
        finally:
            self.pace.tokens_in_flight -= new_tokens
        self.pace.observe(
            len(request.prompt_token_ids) - final.num_cached_tokens, time.monotonic() - started, ahead
        )
        return final

    async def decode(
        self, request: EngineRequest, can_restart: Callable[[], bool] = lambda: False
    ) -> AsyncIterator[tuple[EngineChunk, str] | Restart]:
        """Stream from decode, on up to `DECODE_ATTEMPTS` replicas.

        A replica that fails before the client saw any output (`can_restart()`: before
        the first delta of a streamed turn, at any point of one that does not stream)
        is avoided and the turn goes to another replica, which computes the prompt
        itself (`local_decode_params`: the prefill engine's blocks may already be gone
        to the failed reader, and a second read of freed blocks would load wrong KV). A
        `Restart` tells the caller to drop what the failed attempt produced. A replica
        that fails after output reached the client, or on every attempt, ends the turn
        with a 502 `APIError` (`decode_failed`); the session's next turn recomputes."""
        avoid: list[str] = []
        attempt = request
        for tries in range(1, DECODE_ATTEMPTS + 1):
            produced, replica = False, attempt.preferred_replica
            try:
                async for item in self._clients.decode(attempt):
                    produced, replica = True, item[1]
                    yield item
                return
            except APIError:
                raise
            except Exception as exc:
                if not can_restart() or tries == DECODE_ATTEMPTS:
                    self.counts[TurnCount.DECODE_FAILED] += 1
                    logger.warning("decode %s failed: %r", attempt.request_id, exc)
                    raise DecodeFailed(replica) from exc
                self.counts[TurnCount.DECODE_RETRIED] += 1
                if produced:
                    self.counts[TurnCount.DECODE_RESTARTED] += 1
                logger.warning(
                    "decode %s failed on %s, computing the turn on another replica: %r",
                    attempt.request_id,
                    replica,
                    exc,
                )
            if replica and replica not in avoid:
                avoid.append(replica)
            yield Restart()
            attempt = dataclasses.replace(
                request,
                request_id=f"{request.request_id}-retry{tries}",
                preferred_replica=None,
                avoid_replicas=tuple(avoid),
                kv_params=local_decode_params() if self._cfg.reuses_kv else None,
            )
            await asyncio.sleep(DECODE_RETRY_PAUSE_S * tries)  # Serve learns of a dead replica
