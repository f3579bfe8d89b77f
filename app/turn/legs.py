"""The two engine legs of a turn, with their fallbacks: the prefill leg (pull the history
the claimed handle names, compute the rest, keep the KV for decode; a late or failed pull
recomputes) and the decode leg (stream the answer; a replica that fails before the client
saw output is replaced, up to `DECODE_ATTEMPTS`; one that fails mid-stream is replaced by
one that continues the same answer, up to `ingress.max_continuations`). Called by
`Turns.run` once per turn each (the prefill leg only on the P/D path); every fallback is
counted in the shared counters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest, Sampling
from app.errors import APIError, DecodeFailed
from app.turn.events import Continuation, TurnCount
from app.turn.model import EngineClients, TurnInput
from app.turn.pacing import LegPace
from connector.handle import KVHandle, WireError, local_decode_params, prefill_params

logger = logging.getLogger("ray.serve").getChild(__name__)


@dataclass(frozen=True)
class Prefilled:
    """The prefill leg's result (`Legs.prefill`)."""

    kv_params: dict | None = None
    """Decode's transfer params: read the prompt's KV from the prefill engine. None:
    decode computes the prompt itself (the leg was skipped or failed twice)."""
    cached: int = 0
    """Prompt tokens the prefill engine did not compute (pulled or in its prefix cache)."""
    pulled: bool = False
    """The offered history was read from decode (a short pull counts as not read)."""


@dataclass(frozen=True)
class Output:
    """From `Legs.decode`: a piece of the answer and the decode replica that produced it."""

    chunk: EngineChunk
    replica: str


@dataclass(frozen=True)
class Restart:
    """From `Legs.decode`: the attempt so far failed; another replica starts over."""


DECODE_ATTEMPTS = 3
"""Decode replicas a turn tries before it fails (each after the last failed before output)."""
DECODE_RETRY_PAUSE_S = 0.2
"""Pause before the n-th retry, times n: Serve's routers drop a dead replica within it."""
ENGINE_PARTS = ("input_s", "compute_s", "output_s")
"""The split of an engine leg's time to its first output (`app.engines.engine`), kept in a
turn's timings as `prefill_<part>` and `decode_<part>`."""


def record_engine_timings(timings: dict[str, float], leg: str, engine: Mapping[str, float]) -> None:
    """An engine leg's `EngineChunk.engine_timings` into the turn's `timings`, under the
    leg's name ("prefill", "decode"): `<leg>_engine_s`, `<leg>_queue_s` and its parts."""
    timings[f"{leg}_queue_s"] = engine["queue_s"]
    timings[f"{leg}_engine_s"] = engine["first_token_s"]
    for part in ENGINE_PARTS:
        if part in engine:
            timings[f"{leg}_{part}"] = engine[part]


class Legs:
    """Runs the legs of the turns of one ingress replica (`Turns` owns it)."""

    def __init__(
        self,
        cfg: AppConfig,
        clients: EngineClients,
        counts: Counter[str],
        pace: LegPace,
        piece: Callable[[int], str],
    ):
        self._cfg = cfg
        self._clients = clients
        self._piece = piece
        """One token's text (`Tokenizer.piece`): where a resumed answer's prompt may end."""
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
        prefer: str | None = None,
    ) -> Prefilled:
        """Run the prefill leg. The engine's own times of the leg that answered go into `timings`.

        A leg that pulls history gets a deadline (`LegPace.deadline`: the pull's
        `transfer.pull_timeout_s` on top of the compute expected here); past it the call
        is cancelled (the server aborts the engine request) and prefill recomputes. The
        deadline never passes `pin_deadline`, when the decode engine's pin ends (counted
        as `pull_deadline` rather than `pull_timeout` when that is what cut it). `prefer`:
        the prefill replica to run it on while it lives (one that hosted the session and
        caches its history)."""
        request = EngineRequest(
            request_id=turn.request_id + "-prefill",
            prompt_token_ids=prompt_ids,
            sampling=Sampling(max_tokens=1, temperature=0.0),
            kv_params=prefill_params(history),
            cache_salt=turn.cache_salt,
            preferred_replica=prefer,
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
                return Prefilled()
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
            return Prefilled()
        if timings is not None and final.engine_timings:
            record_engine_timings(timings, "prefill", final.engine_timings)
        try:
            kv_params = KVHandle.from_wire(final.kv_params).to_wire()
        except WireError:
            self.counts[TurnCount.PREFILL_NO_HANDLE] += 1
            kv_params = None
        return Prefilled(kv_params, final.num_cached_tokens, pull_ok)

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
            len(request.prompt_token_ids) - final.num_cached_tokens,
            time.monotonic() - started,
            ahead,
            final.num_cached_tokens,
        )
        return final

    async def decode(
        self, request: EngineRequest, can_restart: Callable[[], bool] = lambda: False
    ) -> AsyncIterator[Output | Restart | Continued]:
        """Stream from decode; a replica that fails is replaced.

        Before the client saw any output (`can_restart()`: before the first delta of a
        streamed turn, at any point of one that does not stream) the turn starts over on
        another replica, up to `DECODE_ATTEMPTS` in all: a `Restart` tells the caller to
        drop what the failed attempt produced. The new attempt computes the prompt itself
        (`local_decode_params`: the prefill engine's blocks may already be gone to the
        failed reader, and a second read of freed blocks would load wrong KV).

        After output reached the client, the answer continues on another replica, up to
        `ingress.max_continuations` times a turn: a `Continued` item, then chunks that go
        on from the next token, never one the caller already has (`continuation_of`: the
        prompt plus the tokens so far, computed there with the same settings and the
        remaining `max_tokens`; or the answer generated again and the tokens already
        sent dropped, where vLLM's state of the answer cannot be rebuilt from a prompt).

        A replica that fails past those bounds, or a replay whose tokens differ from the
        ones sent, ends the turn with a 502 `APIError` (`decode_failed`); the session's
        next turn recomputes."""
        avoid: list[str] = []
        attempt, skip = request, _Skip()
        tries, continuations = 1, 0
        answer: list[int] = []  # tokens of this answer given to the caller, over all attempts
        answer_chars = 0  # and their text's length
        while True:
            produced, finished, replica = False, False, attempt.preferred_replica
            try:
                async for chunk, replica in self._clients.decode(attempt):
                    produced = True
                    trimmed = skip.trim(chunk)
                    if trimmed is None:
                        continue
                    answer.extend(trimmed.token_ids)
                    answer_chars += len(trimmed.text)
                    finished = trimmed.finished
                    yield Output(trimmed, replica)
                return
            except (APIError, Diverged) as exc:
                if isinstance(exc, Diverged):
                    self.counts[TurnCount.DECODE_CONTINUATION_DIVERGED] += 1
                    self.counts[TurnCount.DECODE_FAILED] += 1
                    logger.warning("decode %s: %s", attempt.request_id, exc)
                    raise DecodeFailed(replica) from exc
                raise
            except Exception as exc:
                if finished:  # the answer was whole: only the stream's end was lost
                    return
                if replica and replica not in avoid:
                    avoid.append(replica)
                if can_restart() and tries < DECODE_ATTEMPTS:
                    tries += 1
                    self.counts[TurnCount.DECODE_RETRIED] += 1
                    if produced:
                        self.counts[TurnCount.DECODE_RESTARTED] += 1
                    logger.warning(
                        "decode %s failed on %s, computing the turn on another replica: %r",
                        attempt.request_id,
                        replica,
                        exc,
                    )
                    yield Restart()
                    answer, answer_chars, skip = [], 0, _Skip()
                    attempt = self._another(request, f"{request.request_id}-retry{tries - 1}", avoid)
                    await asyncio.sleep(DECODE_RETRY_PAUSE_S * (tries - 1))  # Serve learns of a dead replica
                    continue
                how = None if can_restart() else continuation_of(request.sampling, len(answer))
                if how is None or continuations >= self._cfg.ingress.max_continuations:
                    if how is not None:
                        self.counts[TurnCount.DECODE_CONTINUATIONS_EXHAUSTED] += 1
                    self.counts[TurnCount.DECODE_FAILED] += 1
                    logger.warning("decode %s failed: %r", attempt.request_id, exc)
                    raise DecodeFailed(replica) from exc
                continuations += 1
                self.counts[TurnCount.DECODE_CONTINUED] += 1
                self.counts[how.counter] += 1
                self.counts[how.of_replica(replica)] += 1
                logger.warning(
                    "decode %s failed on %s after %d tokens reached the client, continuing (%s) on "
                    "another replica: %r",
                    attempt.request_id,
                    replica,
                    len(answer),
                    how,
                    exc,
                )
                yield Continued(replica, how)
                attempt, skip = self._continuation(request, how, answer, answer_chars, continuations, avoid)
                await asyncio.sleep(DECODE_RETRY_PAUSE_S * continuations)

    def _another(self, request: EngineRequest, request_id: str, avoid: list[str], **changes) -> EngineRequest:
        """`request` again, for another replica than those in `avoid`, computing its prompt there."""
        return dataclasses.replace(
            request,
            request_id=request_id,
            preferred_replica=None,
            avoid_replicas=tuple(avoid),
            kv_params=local_decode_params() if self._cfg.reuses_kv else None,
            **changes,
        )

    def _continuation(
        self,
        request: EngineRequest,
        how: Continuation,
        answer: list[int],
        answer_chars: int,
        n: int,
        avoid: list[str],
    ) -> tuple[EngineRequest, _Skip]:
        """The `n`-th continuation of `request`, whose caller has `answer` (and that many
        characters of its text), and what of its output to drop.

        A resumed answer's prompt ends at a character's end: the tokens after it (a
        character's first bytes, whose text the engine held back) are generated again and
        dropped, text kept. vLLM's detokenizer, primed with a prompt that ends
        mid-character, was seen to give the whole prompt's text as the first token's."""
        request_id = f"{request.request_id}-cont{n}"
        if how is not Continuation.RESUMED:
            self.counts[TurnCount.DECODE_REPLAYED_TOKENS] += len(answer)
            return self._another(request, request_id, avoid), _Skip(tuple(answer), answer_chars)
        whole = len(answer)
        while whole and self._piece(answer[whole - 1]).endswith(_PARTIAL):
            whole -= 1
        self.counts[TurnCount.DECODE_CONTINUED_TOKENS] += whole
        self.counts[TurnCount.DECODE_REPLAYED_TOKENS] += len(answer) - whole
        resumed = self._another(
            request,
            request_id,
            avoid,
            prompt_token_ids=tuple(request.prompt_token_ids) + tuple(answer[:whole]),
            sampling=_rest_of(request.sampling, whole),
        )
        return resumed, _Skip(tuple(answer[whole:]))


@dataclass(frozen=True)
class Continued:
    """From `Legs.decode`: the replica failed after output reached the caller; what
    follows goes on from the next token on another replica (nothing is dropped)."""

    failed_replica: str | None
    how: Continuation


class Diverged(Exception):
    """A replayed answer's tokens are not the ones the client already has (sampling
    without a seed): it cannot continue."""


class _Skip:
    """What a replaying continuation drops of its output: the tokens the caller has
    (which must come out the same) and as many characters of text."""

    def __init__(self, tokens: tuple[int, ...] = (), chars: int = 0):
        self._tokens = tokens
        self._chars = chars
        self._seen = 0

    def trim(self, chunk: EngineChunk) -> EngineChunk | None:
        """`chunk` less what the caller has; None when nothing of it is left to give."""
        left = len(self._tokens) - self._seen
        if left <= 0 and self._chars <= 0:
            return chunk
        n = min(left, len(chunk.token_ids))
        if tuple(chunk.token_ids[:n]) != self._tokens[self._seen : self._seen + n]:
            raise Diverged(f"the replay gave other tokens than the {len(self._tokens)} sent")
        self._seen += n
        cut = min(self._chars, len(chunk.text))
        self._chars -= cut
        if chunk.finished and self._seen < len(self._tokens):
            raise Diverged(f"the replay ended after {self._seen} of the {len(self._tokens)} tokens sent")
        if not chunk.finished and n == len(chunk.token_ids) and cut == len(chunk.text):
            return None
        logprobs = chunk.logprobs[n:] if chunk.logprobs is not None else None
        return dataclasses.replace(
            chunk, token_ids=tuple(chunk.token_ids[n:]), text=chunk.text[cut:], logprobs=logprobs
        )


_PARTIAL = "\ufffd"
"""How a token's own text ends when its bytes end inside a character (byte-level BPE)."""

_OUTPUT_STATE = ("stop", "bad_words", "thinking_token_budget", "repetition_detection", "watermarking")
"""vLLM sampling settings that read the answer generated so far (not the prompt)."""


def continuation_of(sampling: Sampling, sent: int) -> Continuation | None:
    """How an answer of which `sent` tokens reached the client continues on another
    replica; None when it cannot (nothing left to generate)."""
    if sent >= sampling.max_tokens:
        return None
    p = sampling.params
    if p is None:
        replay = bool(sampling.stop) or (sampling.temperature > 0 and sampling.seed is not None)
        return Continuation.REPLAYED_OUTPUT if replay else Continuation.RESUMED
    if getattr(p, "structured_outputs", None) is not None:
        return Continuation.REPLAYED_GRAMMAR
    seeded = getattr(p, "temperature", 1.0) > 0 and getattr(p, "seed", None) is not None
    penalised = bool(getattr(p, "presence_penalty", 0.0) or getattr(p, "frequency_penalty", 0.0))
    if seeded or penalised or sampling.stop or any(getattr(p, name, None) for name in _OUTPUT_STATE):
        return Continuation.REPLAYED_OUTPUT
    return Continuation.RESUMED


def _rest_of(sampling: Sampling, sent: int) -> Sampling:
    """`sampling` for the rest of an answer of which `sent` tokens are in the prompt."""
    params: Any = sampling.params
    min_tokens: int = getattr(params, "min_tokens", 0) or 0
    if min_tokens:
        params = params.clone()
        params.min_tokens = max(0, min_tokens - sent)
    return dataclasses.replace(sampling, max_tokens=sampling.max_tokens - sent, params=params)
