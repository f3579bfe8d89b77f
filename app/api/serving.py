"""The turn runner the APIs share (vLLM's `OpenAIServing` in our shape).

Each API's serving class (`chat_serving`, `responses_serving`, `messages_serving`) turns
its request into a chat or completion body and hands it here. A request's life:

1. `prepare`: check what vLLM's request models leave to the engine (model, logprobs,
   token ids), name the session (the header, or the agent's `prompt_cache_key`), render
   and tokenize the prompt off the event loop, build vLLM's `SamplingParams`
   (`to_sampling_params` with the model's generation defaults): a `TurnInput`.
2. `collect` or `chunks`: admit the turn against its tenant's quotas (a 429 before
   anything runs), run it through `app.turn.turns.Turns`, shape its events into one body
   or a stream of OpenAI chunks (`app.api.shaping`), record its metrics.

One `TurnServing` per ingress replica, called concurrently from the replica's event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from app.api import metrics, openai_api, sessions
from app.api.auth import Tenant, scoped
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.quotas import Quotas
from app.api.shaping import ResponseShaper
from app.api.tokenizer import HFTokenizer
from app.config import AppConfig
from app.engines.wire import Sampling
from app.errors import APIError, NotFound, client_error
from app.turn.model import Delta, TurnInput, TurnResult
from app.turn.turns import Turns
from connector.client import StoreClient

logger = logging.getLogger("ray.serve").getChild(__name__)

Render = Callable[[Any], Awaitable[tuple[str | None, tuple[int, ...] | None, Any]]]
"""A body's prompt: its text or its token ids, and vLLM's output parser for it (or None)."""


@dataclass(frozen=True)
class Prepared:
    """A validated request ready to run: the turn, and how its output is shaped."""

    turn: TurnInput
    tenant: Tenant
    parser: Any = None
    """vLLM's tool/reasoning parser for this chat request (None: plain content)."""


async def outliving(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to its end even if the request awaiting it is cancelled (a client that
    hangs up): a task in a context of its own, which Ray does not count among the
    request's children (it cancels those with the request), shielded from the caller's
    cancellation."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    return await asyncio.shield(task)


async def chained(first: Any, rest: AsyncIterator) -> AsyncIterator:
    """A stream whose first item was already awaited (so its errors came before any byte)."""
    yield first
    async for item in rest:
        yield item


async def _noted(events: AsyncIterator, note: Callable[[Any], None]) -> AsyncIterator:
    async for event in events:
        note(event)
        yield event


class TurnServing:
    """Prepares, admits, runs and shapes turns for every API of one ingress replica."""

    def __init__(
        self, cfg: AppConfig, turns: Turns, tokenizer: HFTokenizer, store: StoreClient | None, quotas: Quotas
    ):
        self.cfg = cfg
        self.turns = turns
        self.tok = tokenizer
        self.store = store
        self.quotas = quotas
        self._parsers = openai_api.OutputParsers(cfg, tokenizer.hf)
        self._shaper = ResponseShaper(cfg.model_name, self._parsers.auto_tools, cfg.openai.compact_json)
        self._strip = [re.compile(p, re.MULTILINE) for p in cfg.openai.strip_system_patterns]
        self._sampling_defaults = openai_api.sampling_defaults(cfg)
        self._metrics = metrics.TurnMetrics(cfg.mode.value)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.model_name:
            raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")

    async def prepare(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        session_id: str | None,
        tenant: Tenant,
        *,
        stream: bool,
        request_id: str | None = None,
        retain: bool = False,
    ) -> Prepared:
        """The turn of a chat or completion body (step 1 above)."""
        self.check_model(body.model)
        limits = self.cfg.openai
        logprobs = body.requested_logprobs
        if logprobs is not None and logprobs > limits.max_logprobs:
            name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise APIError(400, f"'{name}' must be at most {limits.max_logprobs}", param=name)
        vocab = self.tok.vocab_size
        for name, checked in body.token_ids_to_check():
            if any(t < 0 or t >= vocab for t in checked):
                raise APIError(
                    400, f"'{name}' has token ids outside the vocabulary (0..{vocab - 1})", param=name
                )
        keyed = False
        agent_key = getattr(body, "prompt_cache_key", None)
        if session_id is None and agent_key:
            session_id = sessions.bounded(agent_key, limits.max_session_id_chars)
            keyed = True
        text: str | None
        ids: tuple[int, ...] | None
        if isinstance(body, ChatCompletionRequest):
            text, ids, parser = await self.render_chat(body)
        else:
            (text, ids), parser = body.prompt_text_or_ids(), None
        if ids is not None and any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, "prompt token ids out of the vocabulary's range", param="prompt")
        if text is not None and ids is None:
            ids = tuple(await asyncio.to_thread(self.tok.encode, text))
        limit = body.answer_limit
        # No limit: the context's room (`Turns` cuts it to what the prompt leaves).
        max_tokens = limit or self.cfg.default_max_tokens or self.cfg.max_model_len
        try:
            params = body.to_sampling_params(max_tokens, self._sampling_defaults)
        except (ValueError, TypeError) as exc:  # vLLM's checks of the client's values
            raise client_error(exc) from exc
        openai_api.apply_min_tokens(params, body, self._sampling_defaults)
        if self.cfg.openai.compact_json:
            openai_api.compact_structural_tag(params)
        openai_api.check_structured_output(params)
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=tuple(params.stop or ()),
            stop_token_ids=tuple(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos,
            params=params,
        )
        prefix = "chatcmpl-" if isinstance(body, ChatCompletionRequest) else "cmpl-"
        turn = TurnInput(
            request_id=request_id or prefix + uuid.uuid4().hex,
            sampling=sampling,
            session_id=scoped(tenant.namespace, session_id),
            namespace=tenant.namespace,
            cache_salt=tenant.salt_for(getattr(body, "cache_salt", None)),
            prompt_text=text,
            prompt_ids=ids,
            max_tokens_given=limit is not None,
            stream=stream,
            retain=retain,
            session_keyed=keyed,
        )
        return Prepared(turn, tenant, parser)

    async def render_chat(self, body: ChatCompletionRequest) -> tuple[str, None, Any]:
        """The rendered prompt of a chat request and its output parser (which may adjust
        the request first: named/required tool choice -> guided JSON)."""
        messages = openai_api.strip_system(body.template_messages(self.cfg.openai.max_messages), self._strip)
        if self.cfg.openai.compact_json:
            messages = openai_api.compact_arguments(messages)
        kwargs = openai_api.template_kwargs(self.cfg, body)
        parser = self._parsers.for_request(body, kwargs)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = await asyncio.to_thread(self.tok.render, messages, tools, kwargs)
        return text, None, parser

    async def collect(self, kind: str, body: Any, prepared: Prepared) -> dict:
        """The whole answer as one OpenAI body (`kind`: `chat.completion` or `text_completion`)."""
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list | None = [] if body.requested_logprobs is not None else None
        result: TurnResult | None = None
        with self._admitted(prepared):
            async for event in self.turns.run(prepared.turn):
                if isinstance(event, Delta):
                    texts.append(event.text)
                    token_ids.extend(event.token_ids)
                    if logprobs is not None and event.logprobs:
                        logprobs.extend(event.logprobs)
                else:
                    result = event
        assert result is not None  # a turn ends with its `TurnResult`
        self._record(result, body, prepared.tenant)
        return self._shaper.response(
            kind, body, prepared.turn, prepared.parser, "".join(texts), token_ids, logprobs, result
        )

    async def chunks(
        self, kind: str, body: Any, prepared: Prepared, note: Callable[[Any], None] | None = None
    ) -> AsyncIterator[dict]:
        """OpenAI chunks of a turn. The turn's first event is awaited before the first
        chunk, so errors raised before the answer starts reach the caller first. `note`:
        called with each turn event before it is shaped."""
        with self._admitted(prepared):
            events = self.turns.run(prepared.turn)
            if note is not None:
                events = _noted(events, note)
            record = lambda result: self._record(result, body, prepared.tenant)  # noqa: E731
            async for chunk in self._shaper.chunks(
                kind, body, prepared.turn, prepared.parser, events, record
            ):
                yield chunk

    async def end_session(self, namespace: str, session_id: str) -> dict:
        """End a kept conversation now: the store forgets it and its decode engine frees
        the blocks pinned for the next turn. 404 if no such session is kept."""
        if self.store is None:
            raise APIError(400, "this deployment keeps no sessions (mode=oneway)", param="session_id")
        if not await self.store.end_session(scoped(namespace, session_id)):
            raise NotFound(f"No session '{session_id}'.", param="session_id", code="session_not_found")
        await self.turns.memory.flush()
        return {"id": session_id, "object": "session", "deleted": True}

    def _admitted(self, prepared: Prepared):
        """The tenant's quotas for this turn (`app.api.quotas`): a 429 before anything runs."""
        return self.quotas.admit(prepared.tenant, len(prepared.turn.prompt_ids or ()))

    def _record(self, result: TurnResult, body: Any, tenant: Tenant) -> None:
        """Metrics of a finished turn (`app.api.metrics`); starts the metrics poll. Never
        raises: metrics must not fail an answer."""
        try:
            index = (
                metrics.chat_turn_index(body.messages) if isinstance(body, ChatCompletionRequest) else None
            )
            self._metrics.record_turn(result, index, tenant.label)
            self._metrics.sync_events(self.turns.counts)
            self._metrics.sync_refusals(self.quotas.refused)
            self._metrics.ensure_polling(
                self.turns.counts, self.store.stats if self.store is not None else None
            )
        except Exception:
            logger.exception("turn metrics failed")
