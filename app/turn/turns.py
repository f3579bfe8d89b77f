"""One turn of a conversation, end to end: the orchestration the ingress runs. `Turns.run`
follows the flow, one step a call, each step's result typed (`app.turn.steps`):

    session   `Sessions.resolve` -> `Session` (`app.turn.session`): which conversation
              (header, agent key, or prompt-token match); claim its KV handle from the
              store (a new session past its tenant's live limit is refused here)
    prompt    `_prompt_ids`: token ids, re-using the ids generated last turn
              (token-in/token-out); `_fit`: the context length
    handle    `_verified_history`: verify the claimed handle token by token, cap it to
              the common prefix, or say why not (`app.turn.events.MissReason`)
    route     `_route` -> `Route`: the session's decode replica alone (`LOCAL`, chosen by
              `app.turn.placement`), through prefill (`PREFILL`), or decode alone (`DECODE`)
    prefill   `Legs.prefill` -> `Prefilled` (`app.turn.legs`): pull that KV from decode,
              compute the rest
    decode    `_decode` over `Legs.decode` -> `Answer`: read back only what it lacks,
              stream (another replica if one fails: from the start before the client saw
              output, else going on with the same answer)
    store     `_conversation` + the store's `end_turn`: keep the decode engine's new handle
              with the exact token sequence, settle the old one

Every fallback (no handle, expired, mismatched, replica gone, failed pull) recomputes and
answers normally; each is counted (`app.turn.events.TurnCount`). Engines and the store are
reached through the seams in `app.turn.model`, so unit tests run this real logic with fakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

from app.config import AppConfig, Mode
from app.engines.setup import decode_prompt_chunk
from app.engines.wire import EngineChunk, EngineRequest, Sampling
from app.errors import APIError, DecodeFailed
from app.fleet.memory import DecodeMemory
from app.turn.events import MissReason, TurnCount
from app.turn.legs import Legs, Output, Prefilled, record_engine_timings
from app.turn.model import Delta, EngineClients, Store, Tokenizer, TurnEvent, TurnInput, TurnResult
from app.turn.pacing import DecodeStreams, LegPace, LocalLeg, loads
from app.turn.placement import Limits, Placement, Reason, place, place_hosted, place_static
from app.turn.replicas import hosting_replica, least_loaded
from app.turn.session import Sessions, text_extends
from app.turn.steps import Answer, Route
from connector.handle import KVHandle, WireError, local_decode_params
from connector.store import Claim, Conversation, TurnOutcome, restrict


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
        self._sessions = Sessions(cfg, self._store, tokenizer, self.counts)
        self.memory = DecodeMemory(cfg, clients, self._store, self.counts)
        t = cfg.transfer
        itl_s, chunk = t.itl_target_ms / 1000, decode_prompt_chunk(cfg)
        self._limits = Limits(t.decode_local_tokens, t.decode_local_busy_tokens, itl_s, chunk)
        self._placement = place if t.placement == "priced" else place_static
        """The placement policy (`transfer.placement`) and its limits, fixed by the config."""
        self.streams = DecodeStreams(itl_s, t.itl_late_fraction)
        """Per decode replica: the answers streaming there, their pace; P/D hand-offs."""
        self._legs = Legs(cfg, self.streams.watch(clients), self.counts, self.pace, tokenizer.piece)

    async def run(self, turn: TurnInput) -> AsyncIterator[TurnEvent]:
        """The turn's deltas as they come (all at the end if it does not stream), then its
        `TurnResult`. Raises `APIError` for what the client must hear (bad prompt, rate
        limit, a decode that failed past its retries)."""
        started = time.monotonic()
        timings: dict[str, float] = {}
        session = await self._sessions.resolve(turn)
        claim, conv = session.claim, session.claim.conversation if session.claim else None
        timings["store_s"] = time.monotonic() - started
        pin_deadline = self._pin_deadline(claim)
        outcome, new_conv, engine_blocks = TurnOutcome.UNUSED, None, None
        try:
            prompt_ids, spliced = self._prompt_ids(turn, session.prompt_ids, conv)
            sampling = self._fit(turn, prompt_ids)
            history, miss = await self._verified_history(claim, prompt_ids, pin_deadline)
            timings["session_s"] = time.monotonic() - started
            route, replica, placement = self._route(prompt_ids, history, conv)
            legged = Prefilled()
            if route is Route.PREFILL:
                host = self._prefill_host(conv.decode_replica if conv is not None else None)
                if host is not None and history is not None:
                    # A prefill replica hosts the session: its leg runs there over the
                    # history that replica caches (no pull), and decode takes the session over.
                    self.counts[TurnCount.HOST_HANDOFF] += 1
                    history = None
                legged = await self._legs.prefill(turn, prompt_ids, history, pin_deadline, timings, host)
                timings["prefill_s"] = time.monotonic() - started
                if history is not None:
                    # A short pull (prefill recomputed instead) may leave decode's blocks
                    # pinned until their TTL: settle it as failed, not pulled.
                    outcome = TurnOutcome.PULLED if legged.pulled else TurnOutcome.FAILED
            request = EngineRequest(
                request_id=turn.request_id,
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                kv_params=self._decode_params(route, legged),
                preferred_replica=replica,
                cache_salt=turn.cache_salt,
            )
            answer = Answer(turn.stream, len(prompt_ids), route is not Route.PREFILL, legged.cached)
            leg = None
            if route is Route.LOCAL and request.preferred_replica:
                new_tokens = len(prompt_ids) - (history.num_tokens if history is not None else 0)
                late = self.streams.of(request.preferred_replica).late
                expected = placement.late_outputs if placement is not None else 0
                leg = LocalLeg(
                    self._local_pace(request.preferred_replica),
                    new_tokens,
                    late,
                    expected,
                    len(prompt_ids) - new_tokens,
                )
            async for delta in self._decode(request, answer, leg, started, timings):
                yield delta
            final = answer.final
            assert final is not None  # `_decode` raised otherwise
            for delta in answer.held:
                yield delta
            cached = legged.cached
            pulled = history.num_tokens if history is not None and legged.pulled else 0
            if answer.recomputed or answer.continued:
                # The answer came from (or ended on) a replica that computed the prompt itself.
                cached, pulled = min(final.num_cached_tokens, len(prompt_ids)), 0
            elif route is not Route.PREFILL:
                cached = final.num_cached_tokens
                if route is Route.LOCAL:
                    self.counts[TurnCount.DECODE_LOCAL_CACHED_TOKENS] += cached
            new_conv = self._conversation(session.session_id, turn, prompt_ids, answer)
            engine_blocks = await self.memory.capacity_of(new_conv)
            self.counts[TurnCount.TURNS] += 1
            self.counts[TurnCount.PROMPT_TOKENS] += len(prompt_ids)
            self.counts[TurnCount.CACHED_TOKENS] += cached
            yield TurnResult(
                session_id=session.session_id.removeprefix(turn.namespace),
                finish_reason=final.finish_reason or "stop",
                prompt_token_ids=tuple(prompt_ids),
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(answer.generated),
                cached_tokens=cached,
                reused_from_decode=pulled,
                miss_reason=miss,
                spliced=spliced,
                decode_replica=answer.replica,
                timings={k: round(v, 4) for k, v in timings.items()},
                placement=str(placement.reason) if placement is not None else None,
            )
        except BaseException:
            if outcome is TurnOutcome.PULLED or (claim and claim.handle):
                outcome = TurnOutcome.FAILED
            raise
        finally:
            if claim is not None and self._store is not None:
                # Shielded: runs even when the client disconnects mid-stream.
                stored = self._store.end_turn(claim, outcome, new_conv, engine_blocks, retain=turn.retain)
                await asyncio.shield(self._sessions.call(stored, None, "end_turn"))
                self.memory.release_soon()

    # -- steps -------------------------------------------------------------------------

    def _prompt_ids(
        self, turn: TurnInput, prompt_ids, conv: Conversation | None
    ) -> tuple[tuple[int, ...], bool]:
        text = turn.prompt_text
        if text is None:
            return tuple(prompt_ids), False
        if self._cfg.sessions.token_in_token_out and text_extends(text, conv):
            assert conv is not None and conv.text is not None
            self.counts[TurnCount.SPLICED] += 1
            return conv.token_ids + tuple(self._tok.encode(text[len(conv.text) :])), True
        if prompt_ids is None:
            prompt_ids = tuple(self._tok.encode(text))
        return tuple(prompt_ids), False

    def _fit(self, turn: TurnInput, prompt_ids: Sequence[int]) -> Sampling:
        room = self._cfg.max_model_len - len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self._cfg.max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for an answer.",
                param="messages",
                code="context_length_exceeded",
            )
        if turn.sampling.max_tokens > room:
            # As vLLM's OpenAI server does: the answer may take what the context has
            # left (it then ends with finish_reason "length").
            if turn.max_tokens_given:
                self.counts[TurnCount.MAX_TOKENS_CLAMPED] += 1
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
            if await self._clients.decode_stopping(conv.decode_replica):
                # Out of the routing set but still up (Serve drains it): its engine still
                # holds the blocks, so pull them; what no turn claims it moves (`app.fleet.drain`).
                self.counts[TurnCount.PULL_FROM_DRAINING] += 1
            else:
                assert self._store is not None  # the claim came from it
                await self._sessions.call(self._store.drop_engine(claim.handle.engine_id), 0, "drop_engine")
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

    def _route(
        self, prompt_ids: Sequence[int], history: KVHandle | None, conv: Conversation | None
    ) -> tuple[Route, str | None, Placement | None]:
        """Where the turn is computed, the decode replica it prefers, and why (the
        placement; None where no choice was made). `Route.LOCAL` in
        bidir when the session's decode replica's prefix cache holds the history (or there
        is none) and `app.turn.placement` chooses it from this ingress's measured loads
        (`transfer.placement`); each choice is counted as `placed_<reason>`. A session with
        no decode replica yet is priced on the one this ingress sees least loaded, and goes
        there when it stays on decode. With `transfer.prefill_hosts` a prefill replica may
        host the session instead (`_placement_of`): `Route.LOCAL` there, and a turn it
        cannot afford goes through prefill to a decode replica. Else through prefill, when
        there is one."""
        replica = conv.decode_replica if conv is not None else None
        placement, priced_on = self._placement_of(prompt_ids, history, replica)
        if placement is not None and placement.local:
            self.counts[TurnCount.DECODE_LOCAL] += 1
            if placement.reason in (Reason.BUSY, Reason.SOONER):  # past `decode_local_tokens`
                self.counts[TurnCount.DECODE_LOCAL_BUSY] += 1
            return Route.LOCAL, priced_on, placement
        if self._prefill_host(replica) is not None:
            replica = None  # handed over: a decode replica reads the leg's blocks
        return (Route.PREFILL if self._cfg.disaggregated else Route.DECODE), replica, placement

    def _placement_of(
        self, prompt_ids: Sequence[int], history: KVHandle | None, replica: str | None
    ) -> tuple[Placement | None, str | None]:
        if not self._cfg.reuses_kv:
            return None, replica
        placement: Placement | None = None
        if history is None:
            new_tokens = len(prompt_ids)
            if not replica and (host := self._hosting_prefill()) is not None:
                # A new session: a prefill replica less loaded than any decode replica hosts it.
                placement = self._place_hosted(host, new_tokens, 0)
                replica = host if placement.local else None
            replica = replica or self._least_loaded_decode()
        elif self._cfg.decode.enable_prefix_caching and replica:
            new_tokens = len(prompt_ids) - history.num_tokens
        else:
            return None, replica
        context = len(prompt_ids) - new_tokens
        if placement is None or not placement.local:
            if self._prefill_host(replica) is not None:
                assert replica is not None
                placement = self._place_hosted(replica, new_tokens, context)
            else:
                local, streams = (
                    (self._local_pace(replica), self.streams.of(replica)) if replica else (None, None)
                )
                prefill, decode = loads(self.pace, self.streams.handoff, local, streams)
                placement = self._placement(new_tokens, prefill, decode, self._limits, context)
        self.counts[TurnCount(f"placed_{placement.reason}")] += 1
        return placement, replica

    def _prefill_host(self, replica: str | None) -> str | None:
        """`replica` (a session's), if it is a prefill replica that hosts sessions
        (`transfer.prefill_hosts`)."""
        if not (self._cfg.prefill_hosts and replica):
            return None
        return replica if self._clients.hosts_on_prefill(replica) else None

    def _hosting_prefill(self) -> str | None:
        """A prefill replica to host a new session (`app.turn.replicas.hosting_replica`), or
        None: decode takes it, as without hosting."""
        if not self._cfg.prefill_hosts:
            return None
        return hosting_replica(
            self._clients.prefill_replicas() or (),
            self._clients.decode_replicas() or (),
            self.streams,
            self.local_pace,
            self.pace.tokens_in_flight,
            time.monotonic(),
        )

    def _place_hosted(self, host: str, new_tokens: int, context: int) -> Placement:
        """`app.turn.placement.place_hosted` on a prefill replica, with its hosted turns and
        streams as this ingress measured them and the prefill legs in flight (while any
        are, the session goes to decode); its engine computes prompts in the decode
        engines' chunks (`app.engines.setup.decode_chunking`)."""
        prefill, load = loads(self.pace, self.streams.handoff, self._local_pace(host), self.streams.of(host))
        assert load is not None
        legs = self.pace.tokens_in_flight
        return place_hosted(new_tokens, load, self._limits, context, prefill.seconds_per_token, legs)

    def _least_loaded_decode(self) -> str | None:
        """Of the running decode replicas, one with the fewest streams and prompt tokens in
        flight from this ingress (at random among equals); None while none is known."""
        return least_loaded(self._clients.decode_replicas() or (), self.streams, self.local_pace)

    def _decode_params(self, route: Route, legged: Prefilled) -> dict | None:
        """Decode's transfer params: compute over the history it holds (`Route.LOCAL`),
        read the prefill engine's blocks, or, prefill skipped, compute the prompt and
        still keep the turn's blocks for the next pull."""
        if route is Route.LOCAL:
            return local_decode_params()
        if route is Route.PREFILL and legged.kv_params is not None:
            return legged.kv_params
        return local_decode_params() if route is Route.PREFILL and self._cfg.reuses_kv else None

    async def _decode(
        self, request: EngineRequest, answer: Answer, leg: LocalLeg | None, started: float, timings: dict
    ) -> AsyncIterator[Delta]:
        """The decode step: the answer's deltas (`Legs.decode`: another replica if one
        fails), gathered in `answer`. Raises `DecodeFailed` when no replica finished it."""
        try:
            async for item in self._legs.decode(request, can_restart=answer.can_restart):
                if isinstance(item, Output):
                    if "first_token_s" not in timings:
                        timings["first_token_s"] = time.monotonic() - started
                        if leg is not None:
                            leg.first_token()
                    engine = item.chunk.engine_timings
                    if engine and "decode_engine_s" not in timings:
                        record_engine_timings(timings, "decode", engine)
                delta = answer.take(item)
                if delta is not None:
                    yield delta
        finally:
            if leg is not None:
                final = answer.final
                computed = (
                    len(request.prompt_token_ids) - final.num_cached_tokens if final is not None else None
                )
                leg.end(None if answer.continued else computed)
        if answer.final is None:
            raise DecodeFailed(answer.replica)

    def _local_pace(self, replica: str) -> LegPace:
        pace = self.local_pace.get(replica)
        if pace is None:
            pace = self.local_pace[replica] = LegPace()
        return pace

    def _conversation(self, session_id: str, turn: TurnInput, prompt_ids, answer: Answer) -> Conversation:
        final = answer.final
        assert final is not None
        handle = None
        if self._cfg.reuses_kv:
            try:
                handle = dataclasses.replace(KVHandle.from_wire(final.kv_params), cache_salt=turn.cache_salt)
            except WireError:
                self.counts[TurnCount.DECODE_NO_HANDLE] += 1
        return Conversation(
            session_id=session_id,
            token_ids=tuple(prompt_ids) + tuple(answer.generated),
            prompt_len=len(prompt_ids),
            text=self._answer_text(turn, answer.generated, answer.text, final),
            handle=handle,
            decode_replica=answer.replica,
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
