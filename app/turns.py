"""One turn of a conversation, end to end: the orchestration the ingress runs.

    session   -> which conversation is this? (header, or prompt-token match)
    prompt    -> token ids (re-using the ids generated last turn: token-in/token-out)
    handle    -> claim the decode engine's KV of the last turn, verify it token by token,
                 cap it to the common prefix
    prefill   -> pull that KV from decode, compute only the rest, keep the result
    decode    -> read back only what it lacks (prefers the session's replica), stream
    store     -> keep the decode engine's new handle with the exact token sequence

Every fallback (no handle, expired, mismatched, replica gone, failed pull) recomputes and
answers normally; each is counted in `TurnCounters`. Engines are reached through the
`EngineClients` seam, the store through `StoreClient`, so unit tests run this real logic
with fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from app.config import AppConfig, Mode
from app.errors import APIError, DecodeFailed, RateLimited
from app.events import MissReason, TurnCount
from app.memory import DecodeMemory, DecodeMemoryClients, MemoryStore
from app.pacing import LegPace, LocalLeg, decode_local_reason
from app.wire import EngineChunk, EngineRequest, Sampling
from connector.handle import KVHandle, WireError, local_decode_params, prefill_params
from connector.store import Claim, Conversation, TurnOutcome, restrict


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def piece(self, token_id: int) -> str:
        """The text of one special token, as a chat template writes it."""
        ...


class EngineClients(DecodeMemoryClients, Protocol):
    """How the orchestration reaches engine replicas (Serve handles in production), the
    decode-memory calls of `app.memory` included."""

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]: ...

    def decode(self, request: EngineRequest) -> AsyncIterator[tuple[EngineChunk, str]]: ...

    def decode_alive(self, replica_id: str) -> bool | None: ...


class Store(MemoryStore, Protocol):
    """The handle store (`connector.actor.StoreClient` in production), with the
    decode-memory hooks of `app.memory`."""

    async def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None = None
    ) -> tuple[str | None, int]: ...

    async def begin_turn(self, session_id: str) -> Claim: ...

    async def end_turn(
        self,
        claim: Claim,
        outcome: TurnOutcome,
        conversation: Conversation | None,
        engine_blocks: int | None = None,
    ) -> None: ...

    async def drop_engine(self, engine_id: str) -> int: ...


@dataclass(frozen=True)
class TurnInput:
    request_id: str
    sampling: Sampling
    session_id: str | None = None
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens_given: bool = True
    namespace: str = ""
    """Tenant prefix of session ids (`app.auth`): `session_id` already carries it; new
    sessions get it and sessionless matches stay inside it. Results show ids without it."""
    cache_salt: str | None = None
    """The tenant's prefix-cache salt (`app.auth.Tenant.salt_for`), on every engine request
    of the turn: cached prefixes only ever hit within one tenant."""
    stream: bool = True
    """The client sees the answer as it is generated. A turn that does not stream gets
    its deltas at the end, so a decode replica that fails midway costs a recompute on
    another replica, not an error."""


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple | None = None
    """The engine's `TokenLogprob`s of these tokens, when the request asked for them."""


@dataclass(frozen=True)
class TurnResult:
    """The end of a turn: what the client is told, and the reuse facts behind it."""

    session_id: str
    finish_reason: str
    prompt_token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reused_from_decode: int
    """Positions of the history offered to prefill from the decode engine (after capping)."""
    miss_reason: str | None
    spliced: bool
    decode_replica: str | None
    timings: dict[str, float] | None = None
    """Where the time to first token went. Milestones, in seconds from the turn's start:
    `store_s` (session resolved: the store's round trip), `session_s` (handle verified
    against the prompt), `prefill_s` (prefill leg back at the ingress, P/D only),
    `first_token_s` (first output from decode). The engines' own spans, from vLLM's
    request stats: `prefill_engine_s` / `decode_engine_s` (arrival at the engine to its
    first token; decode's includes reading the KV it lacks) and their `*_queue_s` parts.
    What `first_token_s` has beyond `session_s` and the two engine spans is transport
    (Serve calls, scheduling, serialization)."""


TurnEvent = Delta | TurnResult


class Turns:
    """Runs turns. One instance per ingress replica; safe for concurrent turns."""

    def __init__(self, cfg: AppConfig, clients: EngineClients, store: Store | None, tokenizer: Tokenizer):
        self._cfg = cfg
        self._clients = clients
        self._store = store if cfg.mode is not Mode.ONEWAY else None
        self._tok = tokenizer
        self.counts: Counter[str] = Counter()
        self.pace = LegPace()
        self.local_pace: dict[str, LegPace] = {}
        """Per decode replica: the turns it computes alone (`_decode_local`)."""
        self.memory = DecodeMemory(cfg, clients, self._store, self.counts)

    async def run(self, turn: TurnInput) -> AsyncIterator[TurnEvent]:
        started = time.monotonic()
        timings: dict[str, float] = {}
        session_id, prompt_ids, claim = await self._resolve_session(turn)
        timings["store_s"] = time.monotonic() - started
        pin_deadline = self._pin_deadline(claim)
        outcome, new_conv, engine_blocks = TurnOutcome.UNUSED, None, None
        try:
            conv = claim.conversation if claim else None
            prompt_ids, spliced = self._prompt_ids(turn, prompt_ids, conv)
            sampling = self._fit(turn, prompt_ids)
            history, miss = await self._verified_history(claim, prompt_ids, pin_deadline)
            timings["session_s"] = time.monotonic() - started
            decode_params, cached, pulled = None, 0, 0
            local = self._decode_local(prompt_ids, history, conv)
            if local:
                # Decode computes the new tokens over the history it holds: no prefill
                # leg, no transfer. The claimed handle is left unread (released early).
                decode_params = local_decode_params()
                self.counts[TurnCount.DECODE_LOCAL] += 1
                if local == "busy":
                    self.counts[TurnCount.DECODE_LOCAL_BUSY] += 1
            elif self._cfg.disaggregated:
                decode_params, cached, pull_ok = await self._prefill(
                    turn, prompt_ids, history, pin_deadline, timings
                )
                timings["prefill_s"] = time.monotonic() - started
                if history is not None:
                    # A short pull (prefill recomputed instead) may leave decode's blocks
                    # pinned until their TTL: settle it as failed, not pulled.
                    outcome = TurnOutcome.PULLED if pull_ok else TurnOutcome.FAILED
                    pulled = history.num_tokens if pull_ok else 0
                if decode_params is None and self._cfg.reuses_kv:
                    # Prefill was skipped: decode computes the prompt and still keeps the
                    # turn's blocks for the next pull.
                    decode_params = local_decode_params()
            request = EngineRequest(
                request_id=turn.request_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                kv_params=decode_params,
                preferred_replica=conv.decode_replica if conv else None,
                cache_salt=turn.cache_salt,
            )
            generated: list[int] = []
            texts: list[str] = []
            held: list[Delta] = []  # a turn that does not stream: its deltas, until the end
            sent = False  # a delta reached the client: the answer can no longer start over
            final, replica, recomputed = None, None, False
            leg = None
            if local and request.preferred_replica:
                new_tokens = len(prompt_ids) - (history.num_tokens if history is not None else 0)
                leg = LocalLeg(self._local_pace(request.preferred_replica), new_tokens)

            def can_restart() -> bool:  # reads `sent` as the loop below sets it
                return not sent

            try:
                async for item in self._decode(request, can_restart=can_restart):
                    if isinstance(item, _Restart):
                        # Another replica computes the prompt (and, if output had begun,
                        # the whole answer) again: nothing of the failed attempt is kept.
                        generated.clear()
                        texts.clear()
                        held.clear()
                        final, recomputed = None, True
                        continue
                    chunk, replica = item
                    if "first_token_s" not in timings:
                        timings["first_token_s"] = time.monotonic() - started
                        if leg is not None:
                            leg.first_token()
                    if chunk.engine_timings and "decode_engine_s" not in timings:
                        timings["decode_queue_s"] = chunk.engine_timings["queue_s"]
                        timings["decode_engine_s"] = chunk.engine_timings["first_token_s"]
                    generated.extend(chunk.token_ids)
                    texts.append(chunk.text)
                    if chunk.token_ids or chunk.text:
                        delta = Delta(chunk.text, chunk.token_ids, chunk.logprobs)
                        if turn.stream:
                            sent = True
                            yield delta
                        else:
                            held.append(delta)
                    if chunk.finished:
                        final = chunk
            finally:
                if leg is not None:
                    leg.end(len(prompt_ids) - final.num_cached_tokens if final is not None else None)
            if final is None:
                raise DecodeFailed(replica)
            for delta in held:
                yield delta
            if recomputed:
                # The answer came from a replica that computed the prompt itself.
                cached, pulled = final.num_cached_tokens, 0
            elif local or not self._cfg.disaggregated:
                cached = final.num_cached_tokens
                if local:
                    self.counts[TurnCount.DECODE_LOCAL_CACHED_TOKENS] += cached
            new_conv = self._conversation(
                session_id, turn, prompt_ids, generated, "".join(texts), final, replica
            )
            engine_blocks = await self.memory.capacity_of(new_conv)
            self.counts[TurnCount.TURNS] += 1
            self.counts[TurnCount.PROMPT_TOKENS] += len(prompt_ids)
            self.counts[TurnCount.CACHED_TOKENS] += cached
            yield TurnResult(
                session_id=session_id.removeprefix(turn.namespace),
                finish_reason=final.finish_reason or "stop",
                prompt_token_ids=tuple(prompt_ids),
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(generated),
                cached_tokens=cached,
                reused_from_decode=pulled,
                miss_reason=miss,
                spliced=spliced,
                decode_replica=replica,
                timings={k: round(v, 4) for k, v in timings.items()},
            )
        except BaseException:
            if outcome is TurnOutcome.PULLED or (claim and claim.handle):
                outcome = TurnOutcome.FAILED
            raise
        finally:
            if claim is not None and self._store is not None:
                # Shielded: runs even when the client disconnects mid-stream.
                stored = self._store.end_turn(claim, outcome, new_conv, engine_blocks)
                await asyncio.shield(self._store_call(stored, None, "end_turn"))
                self.memory.release_soon()

    # -- steps -------------------------------------------------------------------------

    async def _resolve_session(self, turn: TurnInput) -> tuple[str, tuple[int, ...] | None, Claim | None]:
        session_id, prompt_ids = turn.session_id, turn.prompt_ids
        if self._store is None:
            return session_id or turn.namespace + _new_session(), prompt_ids, None
        if session_id is None and self._cfg.sessions.match_sessionless:
            if prompt_ids is None:
                prompt_ids = tuple(self._tok.encode(turn.prompt_text or ""))
            session_id, _ = await self._store_call(
                self._store.match(prompt_ids, turn.prompt_text), (None, 0), "match"
            )
            if session_id is not None and not session_id.startswith(turn.namespace):
                session_id = None  # another tenant's conversation: never matched across
            self.counts[TurnCount.SESSIONLESS_MATCHED if session_id else TurnCount.SESSIONLESS_NEW] += 1
        session_id = session_id or turn.namespace + _new_session()
        # Store unavailable: the turn runs without reuse and is not stored.
        claim = await self._store_call(self._store.begin_turn(session_id), None, "begin_turn")
        if claim is not None and claim.retry_after_s is not None:
            seconds = max(1, math.ceil(claim.retry_after_s))
            raise RateLimited(
                f"Rate limit reached for this API key: its maximum of live sessions. Retry in {seconds} s.",
                seconds,
            )
        return session_id, prompt_ids, claim

    async def _store_call(self, call, default, what: str):
        """Await a store call; if it fails (the client's deadline included), count
        `store_unavailable`, log, and return `default`: a store fault costs reuse, never
        the turn."""
        try:
            return await call
        except Exception as exc:
            self.counts[TurnCount.STORE_UNAVAILABLE] += 1
            logger.warning("store %s failed, turn goes on without it: %r", what, exc)
            return default

    def _prompt_ids(
        self, turn: TurnInput, prompt_ids, conv: Conversation | None
    ) -> tuple[tuple[int, ...], bool]:
        text = turn.prompt_text
        if text is None:
            return tuple(prompt_ids), False
        if (
            self._cfg.sessions.token_in_token_out
            and conv is not None
            and conv.text is not None
            and text.startswith(conv.text)
        ):
            self.counts[TurnCount.SPLICED] += 1
            return conv.token_ids + tuple(self._tok.encode(text[len(conv.text) :])), True
        if prompt_ids is None:
            prompt_ids = tuple(self._tok.encode(text))
        return tuple(prompt_ids), False

    def _fit(self, turn: TurnInput, prompt_ids: Sequence[int]) -> Sampling:
        room = self._cfg.max_model_len - len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        if room < 1 or (turn.max_tokens_given and turn.sampling.max_tokens > room):
            raise APIError(
                400,
                f"This model's maximum context length is {self._cfg.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and {turn.sampling.max_tokens} were requested for the answer.",
                param="messages",
                code="context_length_exceeded",
            )
        if not turn.max_tokens_given and turn.sampling.max_tokens > room:
            return Sampling(**{**turn.sampling.__dict__, "max_tokens": room})
        return turn.sampling

    def _pin_deadline(self, claim: Claim | None) -> float | None:
        """When (this process's monotonic clock) a pull of the claimed handle must be done:
        the decode engine's pin ends `claim.pin_remaining_s` after the claim, less
        `transfer.pin_margin_s`. None: no handle, or the store does not know."""
        remaining = getattr(claim, "pin_remaining_s", None) if claim is not None and claim.handle else None
        if remaining is None:
            return None
        return time.monotonic() + remaining - self._cfg.transfer.pin_margin_s

    async def _verified_history(
        self, claim: Claim | None, prompt_ids: Sequence[int], pin_deadline: float | None = None
    ) -> tuple[KVHandle | None, str | None]:
        if claim is None:
            return None, None
        if claim.handle is None:
            return self._miss(MissReason(claim.miss_reason or MissReason.NO_CONVERSATION))
        if pin_deadline is not None:
            new_tokens = len(prompt_ids) - min(claim.handle.num_tokens, len(prompt_ids) - 1)
            if time.monotonic() + self.pace.expected(new_tokens) >= pin_deadline:
                # The pull could not finish before decode lets the blocks go: recompute.
                return self._miss(MissReason.PIN_DEADLINE)
        conv = claim.conversation
        assert conv is not None  # a claimed handle comes with its conversation
        if conv.decode_replica and self._clients.decode_alive(conv.decode_replica) is False:
            assert self._store is not None  # the claim came from it
            await self._store_call(self._store.drop_engine(claim.handle.engine_id), 0, "drop_engine")
            return self._miss(MissReason.REPLICA_GONE)
        handle, drift = restrict(claim.handle, prompt_ids, conv.token_ids, self._cfg.block_size)
        if drift:
            self.counts[TurnCount.DRIFT_CUT] += 1
            self.counts[TurnCount.DRIFT_TOKENS] += drift
        if handle.num_tokens < max(1, self._cfg.transfer.recompute_threshold_tokens):
            short = handle.num_tokens >= conv.prompt_len
            return self._miss(MissReason.TOO_SHORT if short else MissReason.PREFIX_MISMATCH)
        self.counts[TurnCount.HANDLE_USED] += 1
        return handle, None

    def _miss(self, reason: MissReason) -> tuple[None, MissReason]:
        self.counts[reason.counter] += 1
        return None, reason

    def _decode_local(
        self, prompt_ids: Sequence[int], history: KVHandle | None, conv: Conversation | None
    ) -> Literal["short", "busy"] | None:
        """Whether the session's decode replica computes this turn alone
        (`app.pacing.decode_local_reason`): bidir, with that replica's prefix cache
        holding the history (or no history at all)."""
        if not self._cfg.reuses_kv:
            return None
        replica = conv.decode_replica if conv is not None else None
        if history is None:
            new_tokens = len(prompt_ids)
        elif self._cfg.decode.enable_prefix_caching and replica:
            new_tokens = len(prompt_ids) - history.num_tokens
        else:
            return None
        return decode_local_reason(
            self._cfg.transfer, new_tokens, self.pace, self._local_pace(replica) if replica else None
        )

    def _local_pace(self, replica: str) -> LegPace:
        pace = self.local_pace.get(replica)
        if pace is None:
            pace = self.local_pace[replica] = LegPace()
        return pace

    async def _prefill(
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

    async def _decode(
        self, request: EngineRequest, can_restart: Callable[[], bool] = lambda: False
    ) -> AsyncIterator[tuple[EngineChunk, str] | _Restart]:
        """Stream from decode, on up to `DECODE_ATTEMPTS` replicas.

        A replica that fails before the client saw any output (`can_restart()`: before
        the first delta of a streamed turn, at any point of one that does not stream)
        is avoided and the turn goes to another replica, which computes the prompt
        itself (`local_decode_params`: the prefill engine's blocks may already be gone
        to the failed reader, and a second read of freed blocks would load wrong KV). A
        `_Restart` tells the caller to drop what the failed attempt produced. A replica
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
            yield _Restart()
            attempt = dataclasses.replace(
                request,
                request_id=f"{request.request_id}-retry{tries}",
                preferred_replica=None,
                avoid_replicas=tuple(avoid),
                kv_params=local_decode_params() if self._cfg.reuses_kv else None,
            )
            await asyncio.sleep(DECODE_RETRY_PAUSE_S * tries)  # Serve learns of a dead replica

    def _conversation(
        self, session_id, turn: TurnInput, prompt_ids, generated, text, final: EngineChunk, replica
    ) -> Conversation:
        handle = None
        if self._cfg.reuses_kv:
            try:
                handle = KVHandle.from_wire(final.kv_params)
            except WireError:
                self.counts[TurnCount.DECODE_NO_HANDLE] += 1
        return Conversation(
            session_id=session_id,
            token_ids=tuple(prompt_ids) + tuple(generated),
            prompt_len=len(prompt_ids),
            text=self._answer_text(turn, generated, text, final),
            handle=handle,
            decode_replica=replica,
        )

    def _answer_text(self, turn: TurnInput, generated, text: str, final: EngineChunk) -> str | None:
        """Rendered text equal to prompt + generated ids, or None if not exactly known."""
        if turn.prompt_text is None or isinstance(final.stop_reason, str):
            return None  # token prompts, or a stop string cut the text off the ids
        suffix = ""
        if final.finish_reason == "stop" and generated:
            # The stop/EOS token is in the ids but not in the text the client receives.
            suffix = self._tok.piece(generated[-1])
        return turn.prompt_text + text + suffix


@dataclass(frozen=True)
class _Restart:
    """From `Turns._decode`: the attempt so far failed; another replica starts over."""


DECODE_ATTEMPTS = 3
"""Decode replicas a turn tries before it fails (each after the last failed before output)."""
DECODE_RETRY_PAUSE_S = 0.2
"""Pause before the n-th retry, times n: Serve's routers drop a dead replica within it."""


logger = logging.getLogger("ray.serve")


def _new_session() -> str:
    return "s-" + uuid.uuid4().hex
