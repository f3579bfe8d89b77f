"""The ingress deployment: OpenAI-compatible HTTP API and Python handle methods.

It renders chat prompts, runs each turn through `app.turn.turns.Turns`, and turns events into
OpenAI response bodies (streaming SSE or not). Errors become OpenAI-style bodies in one
place (`_error_response`); clients never reach the engines' transfer machinery.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import messages_api, metrics, openai_api, responses_api, sessions
from app.api.auth import ApiKeys, Tenant, scoped
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.quotas import Quotas
from app.api.shaping import ResponseShaper, sse
from app.api.tokenizer import HFTokenizer
from app.config import AppConfig
from app.engines.wire import ReplicaQuery, Sampling
from app.errors import APIError, NotFound, ServerError, as_api_error, client_error, error_body
from app.fleet.clients import ServeEngineClients, store_settings
from app.fleet.routing import LiveReplicas
from app.turn.events import TurnCount
from app.turn.model import Delta, TurnInput, TurnResult
from app.turn.turns import Turns
from connector.actor import StoreClient, StoreUnavailable
from connector.response_store import StoredResponse

logger = logging.getLogger("ray.serve")
api = FastAPI(title="kvturn", description="OpenAI-compatible multi-turn P/D serving")


def _headers(exc: BaseException) -> dict | None:
    return getattr(exc, "headers", None) if isinstance(exc, (StarletteHTTPException, APIError)) else None


def _error_response(exc: BaseException, shape=error_body) -> JSONResponse:
    """Every error as a body with its status: OpenAI's `{"error": {...}}`, or the shape
    of another API (`messages_api.error_shape`)."""
    status, body = shape(exc)
    return JSONResponse(body, status_code=status, headers=_headers(exc))


api.add_exception_handler(APIError, lambda request, exc: _error_response(exc))
api.add_exception_handler(RequestValidationError, lambda request, exc: _error_response(exc))
# 404 / 405 and other routing errors: OpenAI's shape instead of FastAPI's {"detail": ...}.
api.add_exception_handler(StarletteHTTPException, lambda request, exc: _error_response(exc))


def _handle_errors(method):
    """The handle methods' one error path: whatever fails reaches a `DeploymentHandle`
    caller as the `APIError` an HTTP client would get as a body (status, type, code),
    without its cause (a library's exception need not pickle across Ray; the unexpected
    ones are logged by `error_body`)."""
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(*args, **kwargs):
            try:
                async for item in method(*args, **kwargs):
                    yield item
            except APIError:
                raise
            except Exception as exc:
                raise as_api_error(exc) from None

        return stream

    @functools.wraps(method)
    async def call(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except APIError:
            raise
        except Exception as exc:
            raise as_api_error(exc) from None

    return call


@dataclass(frozen=True)
class _Prepared:
    """A validated request ready to run: the turn, and how its output is shaped."""

    turn: TurnInput
    tenant: Tenant
    parser: Any = None
    """vLLM's tool/reasoning parser for this chat request (None: plain content)."""


async def _outliving(coro) -> Any:
    """Run `coro` to its end even if the request awaiting it is cancelled (a client that
    hangs up): a task in a context of its own, which Ray does not count among the
    request's children (it cancels those with the request), shielded from the caller's
    cancellation."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    return await asyncio.shield(task)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _noted(events: AsyncIterator, note) -> AsyncIterator:
    async for event in events:
        note(event)
        yield event


async def _named_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Responses stream events as server-sent events named by their type."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    """HTTP routes and handle methods. Handle callers: `chat`, `chat_stream`,
    `completions`, `completions_stream` take the OpenAI body as a dict.

    `store` is the app's `SessionStore` deployment (None in oneway mode): its shards are
    fetched at the first store call and checked to run with this config's settings."""

    def __init__(
        self,
        cfg: AppConfig,
        prefill: DeploymentHandle | None,
        decode: DeploymentHandle,
        store: DeploymentHandle | None = None,
        ingress_replicas: int = 1,
    ):
        self._cfg = cfg
        self._prefill = prefill
        self._decode = decode
        self._tok = HFTokenizer(cfg.tokenizer or cfg.model)
        self._parsers = openai_api.OutputParsers(cfg, self._tok.hf)
        self._shaper = ResponseShaper(cfg.model_name, self._parsers.auto_tools, cfg.openai.compact_json)
        self._strip = [re.compile(p, re.MULTILINE) for p in cfg.openai.strip_system_patterns]
        self._merge_inline_system = messages_api.merge_inline_system(self._tok.hf)
        self._sampling_defaults = openai_api.sampling_defaults(cfg)
        self._store = StoreClient.of_deployment(store, store_settings(cfg)) if store is not None else None
        store = self._store
        app_name = serve.get_replica_context().app_name
        self._keys = ApiKeys.of(cfg.access)
        self._quotas = Quotas(ingress_replicas)
        self._metrics = metrics.TurnMetrics(cfg.mode.value)
        timed_store = metrics.TimedStore(store) if store is not None else None
        self._turns = Turns(
            cfg,
            ServeEngineClients(prefill, decode, LiveReplicas(app_name, "DecodeServer")),
            timed_store,
            self._tok,
        )

    # -- HTTP ----------------------------------------------------------------------------

    @api.get("/health")
    async def health(self):
        """200 once an engine replica of each role answers (within 5 s), 503 before:
        load balancers and scripts can wait on it while the engines start."""
        engines = {"decode": self._decode}
        if self._prefill is not None:
            engines["prefill"] = self._prefill
        results = await asyncio.gather(
            *(asyncio.wait_for(h.stats.remote(ReplicaQuery()), 5.0) for h in engines.values()),
            return_exceptions=True,
        )
        waiting = [role for role, r in zip(engines, results, strict=True) if isinstance(r, BaseException)]
        if waiting:
            detail = f"engines not ready: {', '.join(sorted(waiting))}"
            return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._keys.namespace(request.headers.get("authorization"))
        except APIError as exc:
            return _error_response(exc)
        return {
            "object": "list",
            "data": [{"id": self._cfg.model_name, "object": "model", "created": 0, "owned_by": "kvturn"}],
        }

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._http(request, ChatCompletionRequest, self._chat_events, "chat.completion")

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http(request, CompletionRequest, self._completion_events, "text_completion")

    @api.delete("/v1/sessions/{session_id}")
    async def http_end_session(self, session_id: str, request: Request):
        """End a conversation now (see `end_session`): 200 with
        `{"id", "object": "session", "deleted": true}`, 404 if no such session is kept."""
        try:
            namespace = self._keys.namespace(request.headers.get("authorization"))
            return await self._end_session(scoped(namespace, session_id), session_id)
        except Exception as exc:
            return _error_response(exc)

    # -- agents' APIs: Anthropic Messages, OpenAI Responses ------------------------------

    @api.post("/v1/messages")
    async def http_messages(self, request: Request):
        """Anthropic's Messages API (`app.api.messages_api`); errors in Anthropic's shape."""
        try:
            tenant = self._keys.tenant(messages_api.authorization(request.headers))
            session_id = self._session_header(request)
            data = await openai_api.read_body(request, self._cfg.openai.max_request_bytes)
            if data.get("stream"):
                events = self._message_events(data, session_id, tenant)
                first = await anext(events)  # errors before the answer: a status
                return StreamingResponse(_chain(first, events), media_type="text/event-stream")
            return JSONResponse(await self._message(data, session_id, tenant))
        except Exception as exc:
            return _error_response(exc, messages_api.error_shape)

    @api.post("/v1/messages/count_tokens")
    async def http_count_tokens(self, request: Request):
        try:
            self._keys.tenant(messages_api.authorization(request.headers))
            data = await openai_api.read_body(request, self._cfg.openai.max_request_bytes)
            return await self._count_tokens(data)
        except Exception as exc:
            return _error_response(exc, messages_api.error_shape)

    @api.post("/v1/responses")
    async def http_responses(self, request: Request):
        """OpenAI's Responses API (`app.api.responses_api`), stateful by `previous_response_id`."""
        try:
            tenant = self._keys.tenant(request.headers.get("authorization"))
            session_id = self._session_header(request)
            data = await openai_api.read_body(request, self._cfg.openai.max_request_bytes)
            if data.get("stream"):
                events = self._response_events(data, session_id, tenant)
                first = await anext(events)
                return StreamingResponse(_named_events(_chain(first, events)), media_type="text/event-stream")
            return JSONResponse(await self._response(data, session_id, tenant))
        except Exception as exc:
            return _error_response(exc)

    @api.get("/v1/responses/{response_id}")
    async def http_get_response(self, response_id: str, request: Request):
        try:
            namespace = self._keys.namespace(request.headers.get("authorization"))
            return (await self._stored_response(namespace, response_id)).body
        except Exception as exc:
            return _error_response(exc)

    @api.get("/v1/responses/{response_id}/input_items")
    async def http_input_items(self, response_id: str, request: Request):
        try:
            namespace = self._keys.namespace(request.headers.get("authorization"))
            items = (await self._stored_response(namespace, response_id)).input_items
            return {
                "object": "list",
                "data": items,
                "first_id": items[0].get("id") if items else None,
                "last_id": items[-1].get("id") if items else None,
                "has_more": False,
            }
        except Exception as exc:
            return _error_response(exc)

    @api.delete("/v1/responses/{response_id}")
    async def http_delete_response(self, response_id: str, request: Request):
        """Forget a stored response; if no response continued it yet, its conversation's
        pinned KV is freed too, as `DELETE /v1/sessions/{id}` does."""
        try:
            namespace = self._keys.namespace(request.headers.get("authorization"))
            return await self._delete_response(namespace, response_id)
        except Exception as exc:
            return _error_response(exc)

    @api.get("/v1/kv/stats")
    async def kv_stats(self, request: Request):
        """Reuse counters: this ingress replica's turns, the handle store, the engines.
        404 when `access.expose_kv_stats` is off. With API keys, the store's per-tenant
        figures show the caller's own tenant only."""
        try:
            tenant = self._keys.tenant(request.headers.get("authorization"))
            if not self._cfg.access.expose_kv_stats:
                raise NotFound("Not Found")
        except APIError as exc:
            return _error_response(exc)
        stats = await self.stats()
        if self._keys.enabled:
            for shard in (stats.get("store") or {}).get("shards", []):
                own = (shard.get("tenants") or {}).get(tenant.namespace)
                shard["tenants"] = {tenant.namespace: own} if own else {}
                responses = shard.get("responses") or {}
                kept = (responses.get("response_tenants") or {}).get(tenant.namespace)
                responses["response_tenants"] = {tenant.namespace: kept} if kept else {}
            stats["quota_refusals"] = {
                q: n for (t, q), n in self._quotas.refused.items() if t == tenant.label
            }
        else:
            stats["quota_refusals"] = {f"{t}/{q}": n for (t, q), n in self._quotas.refused.items()}
        return stats

    async def _http(self, request: Request, model_cls, events, kind: str):
        try:
            tenant = self._keys.tenant(request.headers.get("authorization"))
            session_id = self._session_header(request)
            data = await openai_api.read_body(request, self._cfg.openai.max_request_bytes)
            body = model_cls.model_validate(data)
            prepared = await self._prepare(body, session_id, events, tenant, stream=bool(body.stream))
            if body.stream:
                # Peek: everything knowable before the first byte (context length, the
                # engine refusing the request) answers with its status, not in-stream.
                chunks = self._chunks(kind, body, prepared)
                first = await anext(chunks)
                return StreamingResponse(sse(first, chunks), media_type="text/event-stream")
            result = await self._collect(kind, body, prepared)
            return JSONResponse(
                result, headers={self._cfg.sessions.session_header: result["kvturn"]["session_id"]}
            )
        except Exception as exc:
            return _error_response(exc)

    # -- handle methods -----------------------------------------------------------------

    # Handle callers are trusted (`app.api.auth`); `api_key` makes them that key's tenant.

    @_handle_errors
    async def chat(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> dict:
        """Non-streaming chat completion for `DeploymentHandle` callers. Raises APIError."""
        return await self._call(
            ChatCompletionRequest, self._chat_events, "chat.completion", body, session_id, api_key
        )

    @_handle_errors
    async def chat_stream(
        self, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> AsyncIterator[dict]:
        """Streaming chat completion chunks (use `handle.options(stream=True)`)."""
        async for chunk in self._call_stream(
            ChatCompletionRequest, self._chat_events, "chat.completion", body, session_id, api_key
        ):
            yield chunk

    @_handle_errors
    async def completions(
        self, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> dict:
        return await self._call(
            CompletionRequest, self._completion_events, "text_completion", body, session_id, api_key
        )

    @_handle_errors
    async def completions_stream(
        self, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> AsyncIterator[dict]:
        async for chunk in self._call_stream(
            CompletionRequest, self._completion_events, "text_completion", body, session_id, api_key
        ):
            yield chunk

    @_handle_errors
    async def end_session(self, session_id: str, api_key: str | None = None) -> dict:
        """End a conversation for `DeploymentHandle` callers: the store forgets it and its
        decode engine frees the blocks it pinned for the next turn at once (not at
        `decoder_kv_blocks_ttl`). A later turn with the same id starts a new conversation.
        Raises `APIError` 404 if no such session is kept (unknown, already ended, evicted)."""
        return await self._end_session(scoped(self._keys.handle_namespace(api_key), session_id), session_id)

    @_handle_errors
    async def messages(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> dict:
        """Anthropic Messages API for `DeploymentHandle` callers (the body as a dict)."""
        openai_api.check_json_values(body)
        return await self._message(body, session_id, self._keys.handle_tenant(api_key))

    @_handle_errors
    async def messages_stream(
        self, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> AsyncIterator[dict]:
        """Anthropic stream events as dicts (use `handle.options(stream=True)`)."""
        openai_api.check_json_values(body)
        async for event in self._message_events(body, session_id, self._keys.handle_tenant(api_key)):
            yield messages_api.sse_dict(event)

    @_handle_errors
    async def responses(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> dict:
        """Responses API for `DeploymentHandle` callers (the body as a dict)."""
        openai_api.check_json_values(body)
        return await self._response(body, session_id, self._keys.handle_tenant(api_key))

    @_handle_errors
    async def responses_stream(
        self, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> AsyncIterator[dict]:
        """Responses stream events (use `handle.options(stream=True)`)."""
        openai_api.check_json_values(body)
        async for event in self._response_events(body, session_id, self._keys.handle_tenant(api_key)):
            yield event

    @_handle_errors
    async def get_response(self, response_id: str, api_key: str | None = None) -> dict:
        return (await self._stored_response(self._keys.handle_namespace(api_key), response_id)).body

    @_handle_errors
    async def delete_response(self, response_id: str, api_key: str | None = None) -> dict:
        return await self._delete_response(self._keys.handle_namespace(api_key), response_id)

    async def _end_session(self, key: str, session_id: str) -> dict:
        if self._store is None:
            raise APIError(400, "this deployment keeps no sessions (mode=oneway)", param="session_id")
        if not await self._store.end_session(key):
            raise NotFound(f"No session '{session_id}'.", param="session_id", code="session_not_found")
        await self._turns.memory.flush()
        return {"id": session_id, "object": "session", "deleted": True}

    async def stats(self) -> dict:
        out: dict[str, Any] = {"turns": {str(k): v for k, v in self._turns.counts.items()}}
        if self._store is not None:
            try:
                out["store"] = await self._store.stats()
            except StoreUnavailable as exc:  # restarting or redeploying: say so, don't fail
                out["store"] = {"unavailable": str(exc)}
        return out

    async def _call(self, model_cls, events, kind, body, session_id, api_key=None):
        tenant = self._keys.handle_tenant(api_key)
        parsed = self._validate(model_cls, body)
        prepared = await self._prepare(parsed, session_id, events, tenant, stream=False)
        return await self._collect(kind, parsed, prepared)

    async def _call_stream(self, model_cls, events, kind, body, session_id, api_key=None):
        tenant = self._keys.handle_tenant(api_key)
        parsed = self._validate(model_cls, body)
        prepared = await self._prepare(parsed, session_id, events, tenant, stream=True)
        async for chunk in self._chunks(kind, parsed, prepared):
            yield chunk

    @staticmethod
    def _validate(model_cls, body: dict):
        """Errors become the caller's `APIError` in `_handle_errors`."""
        openai_api.check_json_values(body)
        return model_cls.model_validate(body)

    # -- turns -> OpenAI bodies ---------------------------------------------------------

    async def _prepare(
        self,
        body,
        session_id: str | None,
        events,
        tenant: Tenant,
        *,
        stream: bool = True,
        request_id: str | None = None,
        retain: bool = False,
    ) -> _Prepared:
        """Validate what vLLM's request models leave to the engine, render and tokenize
        (off the event loop: prompts can be large), and build the decode engine's
        SamplingParams with vLLM's own `to_sampling_params`."""
        if body.model is not None and body.model != self._cfg.model_name:
            raise NotFound(f"The model '{body.model}' does not exist.", param="model", code="model_not_found")
        logprobs = body.requested_logprobs
        if logprobs is not None and logprobs > self._cfg.openai.max_logprobs:
            name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise APIError(400, f"'{name}' must be at most {self._cfg.openai.max_logprobs}", param=name)
        vocab = self._tok.vocab_size
        for name, ids in body.token_ids_to_check():
            if any(t < 0 or t >= vocab for t in ids):
                raise APIError(
                    400, f"'{name}' has token ids outside the vocabulary (0..{vocab - 1})", param=name
                )
        keyed = False
        if session_id is None and getattr(body, "prompt_cache_key", None):
            session_id = sessions.bounded(body.prompt_cache_key, self._cfg.openai.max_session_id_chars)
            keyed = True
        text, ids, parser = await events(body)
        if ids is not None and any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, "prompt token ids out of the vocabulary's range", param="prompt")
        if text is not None and ids is None:
            ids = tuple(await asyncio.to_thread(self._tok.encode, text))
        limit = body.answer_limit
        # No limit: the context's room (`Turns` cuts it to what the prompt leaves).
        max_tokens = limit or self._cfg.default_max_tokens or self._cfg.max_model_len
        try:
            params = body.to_sampling_params(max_tokens, self._sampling_defaults)
        except (ValueError, TypeError) as exc:  # vLLM's checks of the client's values
            raise client_error(exc) from exc
        openai_api.apply_min_tokens(params, body, self._sampling_defaults)
        if self._cfg.openai.compact_json:
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
        turn = TurnInput(
            request_id=request_id
            or ("chatcmpl-" if isinstance(body, ChatCompletionRequest) else "cmpl-") + uuid.uuid4().hex,
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
        return _Prepared(turn, tenant, parser)

    async def _chat_events(self, body: ChatCompletionRequest):
        """The rendered prompt of a chat request and its output parser (which may adjust
        the request first: named/required tool choice -> guided JSON)."""
        messages = openai_api.strip_system(body.template_messages(self._cfg.openai.max_messages), self._strip)
        if self._cfg.openai.compact_json:
            messages = openai_api.compact_arguments(messages)
        kwargs = openai_api.template_kwargs(self._cfg, body)
        parser = self._parsers.for_request(body, kwargs)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = await asyncio.to_thread(self._tok.render, messages, tools, kwargs)
        return text, None, parser

    async def _completion_events(self, body: CompletionRequest):
        text, ids = body.prompt_text_or_ids()
        return text, ids, None

    def _record_turn(self, result: TurnResult, body, tenant: Tenant) -> None:
        """Metrics of a finished turn (`app.api.metrics`); starts the metrics poll. Never
        raises: metrics must not fail an answer."""
        try:
            index = (
                metrics.chat_turn_index(body.messages) if isinstance(body, ChatCompletionRequest) else None
            )
            self._metrics.record_turn(result, index, tenant.label)
            self._metrics.sync_events(self._turns.counts)
            self._metrics.sync_refusals(self._quotas.refused)
            self._metrics.ensure_polling(
                self._turns.counts, self._store.stats if self._store is not None else None
            )
        except Exception:
            logger.exception("turn metrics failed")

    async def _collect(self, kind: str, body, prepared: _Prepared) -> dict:
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list | None = [] if body.requested_logprobs is not None else None
        result: TurnResult | None = None
        with self._admitted(prepared):
            async for event in self._turns.run(prepared.turn):
                if isinstance(event, Delta):
                    texts.append(event.text)
                    token_ids.extend(event.token_ids)
                    if logprobs is not None and event.logprobs:
                        logprobs.extend(event.logprobs)
                else:
                    result = event
        assert result is not None  # a turn ends with its `TurnResult`
        self._record_turn(result, body, prepared.tenant)
        return self._shaper.response(
            kind, body, prepared.turn, prepared.parser, "".join(texts), token_ids, logprobs, result
        )

    async def _chunks(self, kind: str, body, prepared: _Prepared, note=None) -> AsyncIterator[dict]:
        """OpenAI chunks of a turn. The turn's first event is awaited before the first
        chunk, so errors raised before the answer starts reach the caller first. `note`:
        called with each turn event before it is shaped."""
        with self._admitted(prepared):
            events = self._turns.run(prepared.turn)
            if note is not None:
                events = _noted(events, note)
            record = lambda result: self._record_turn(result, body, prepared.tenant)  # noqa: E731
            async for chunk in self._shaper.chunks(
                kind, body, prepared.turn, prepared.parser, events, record
            ):
                yield chunk

    def _admitted(self, prepared: _Prepared):
        """The tenant's quotas for this turn (`app.api.quotas`): a 429 before anything runs."""
        return self._quotas.admit(prepared.tenant, len(prepared.turn.prompt_ids or ()))

    # -- agents' APIs over the chat pipeline ----------------------------------------------

    def _session_header(self, request: Request) -> str | None:
        session_id = request.headers.get(self._cfg.sessions.session_header)
        if session_id is not None and not 0 < len(session_id) <= self._cfg.openai.max_session_id_chars:
            raise APIError(
                400,
                f"the session id must have 1 to {self._cfg.openai.max_session_id_chars} characters",
                param=self._cfg.sessions.session_header,
            )
        return session_id

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._cfg.model_name:
            raise NotFound(f"The model '{model}' does not exist.", param="model", code="model_not_found")

    def _message_request(self, data: dict) -> tuple[ChatCompletionRequest, bool]:
        request = messages_api.parse(data)
        self._check_model(request.model)
        body = messages_api.chat_request(request, merge_inline_system=self._merge_inline_system)
        body.prompt_cache_key = sessions.claude_code_session(request.metadata)
        return messages_api.chat_extensions(data, body), messages_api.long_retention(data)

    async def _message(self, data: dict, session_id: str | None, tenant: Tenant) -> dict:
        body, retain = self._message_request(data)
        prepared = await self._prepare(
            body, session_id, self._chat_events, tenant, stream=False, retain=retain
        )
        return messages_api.message(await self._collect("chat.completion", body, prepared))

    async def _message_events(self, data: dict, session_id: str | None, tenant: Tenant) -> AsyncIterator[str]:
        body, retain = self._message_request(data)
        prepared = await self._prepare(
            body, session_id, self._chat_events, tenant, stream=True, retain=retain
        )
        reused: list[int] = []  # the first delta's count of prompt tokens not computed

        def note(event) -> None:
            if isinstance(event, Delta) and event.cached_tokens is not None and not reused:
                reused.append(event.cached_tokens)

        chunks = self._chunks("chat.completion", body, prepared, note)
        first = await anext(chunks)  # the turn's first event is in: `reused` is known
        prompt_tokens = len(prepared.turn.prompt_ids or ())
        cached = reused[0] if reused else None
        async for event in messages_api.events(_chain(first, chunks), prompt_tokens, cached):
            yield event

    async def _count_tokens(self, data: dict) -> dict:
        request = messages_api.parse(data, count_tokens=True)
        self._check_model(request.model)
        body = messages_api.chat_request(request, merge_inline_system=self._merge_inline_system)
        text, _, _ = await self._chat_events(body)
        return {"input_tokens": len(await asyncio.to_thread(self._tok.encode, text))}

    async def _response_turn(self, data: dict, session_id: str | None, tenant: Tenant, *, stream: bool):
        """Parse a Responses request, resolve the response it continues (its session, or
        a new one for a fork), and prepare its turn. A continuation it owns is given back
        if anything fails before its own response is stored (`_release`)."""
        request = responses_api.parse(data)
        self._check_model(request.model)
        left_out = responses_api.hosted_tools(data)
        if left_out:
            self._turns.counts[TurnCount.HOSTED_TOOLS_LEFT_OUT] += len(left_out)
        previous, owner = None, False
        if request.previous_response_id is not None:
            previous, owner = await self._continue(tenant.namespace, request)
            # The first to continue a response carries on its session and KV; a fork
            # starts a session of its own (it reuses what the engines' caches still hold).
            session_id = previous.session_id if owner else uuid.uuid4().hex
        turn = responses_api.ResponseTurn(request, tenant, previous, owner)
        try:
            history = previous.messages if previous is not None else None
            turn.messages = responses_api.chat_messages(request, history)
            turn.body = responses_api.chat_request(request, turn.messages)
            turn.prepared = await self._prepare(
                turn.body, session_id, self._chat_events, tenant, stream=stream, request_id=request.request_id
            )
        except BaseException:
            await _outliving(self._release(turn))
            raise
        return turn

    async def _continue(self, namespace: str, request):
        if self._store is None:
            raise APIError(
                400, "this deployment keeps no responses (mode=oneway)", param="previous_response_id"
            )
        key = scoped(namespace, request.previous_response_id)
        try:
            previous, owner = await self._store.continue_response(key, request.request_id)
        except StoreUnavailable as exc:
            raise ServerError(503, f"the response store is unavailable, retry: {exc}") from exc
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id '{request.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return previous, owner

    async def _release(self, turn: responses_api.ResponseTurn) -> None:
        if turn.owner and turn.previous is not None and self._store is not None:
            try:
                await self._store.release_continuation(turn.previous.key, turn.request.request_id)
            except StoreUnavailable:
                pass  # the continuation stays taken: later ones fork (reuse lost, never an answer)

    async def _response(self, data: dict, session_id: str | None, tenant: Tenant) -> dict:
        turn = await self._response_turn(data, session_id, tenant, stream=False)
        try:
            chat = await self._collect("chat.completion", turn.body, turn.prepared)
            choice = chat["choices"][0]
            output = responses_api.output_items(turn.request, choice["message"])
            response = responses_api.body(
                turn.request,
                turn.prepared.turn.sampling.params,
                self._cfg.model_name,
                chat["created"],
                output,
                choice["finish_reason"],
                chat["usage"],
                chat["kvturn"],
            )
            await _outliving(self._keep_response(turn, response))
        except BaseException:
            await _outliving(self._release(turn))
            raise
        return response

    async def _response_events(
        self, data: dict, session_id: str | None, tenant: Tenant
    ) -> AsyncIterator[dict]:
        turn = await self._response_turn(data, session_id, tenant, stream=True)
        kept = False
        try:
            chunks = self._chunks("chat.completion", turn.body, turn.prepared)
            first = await anext(chunks)
            stream = responses_api.EventStream(
                turn.request, turn.prepared.turn.sampling.params, self._cfg.model_name
            )

            async def keep(response: dict) -> None:
                nonlocal kept
                await _outliving(self._keep_response(turn, response))
                kept = True

            async for event in responses_api.events(stream, _chain(first, chunks), keep):
                yield event
        finally:
            if not kept:
                await _outliving(self._release(turn))

    async def _keep_response(self, turn: responses_api.ResponseTurn, response: dict) -> None:
        """Store a finished response (unless `store: false`) with what it added to its
        conversation: its input messages and its output as the next turn renders it."""
        if not turn.request.store or self._store is None:
            return
        stored, history = turn.stored(response)
        try:
            result = await self._store.put_response(stored, history)
        except StoreUnavailable as exc:
            logger.warning("response %s not stored: %r", response["id"], exc)
            result = "unavailable"
        if result != "stored":
            self._turns.counts[f"responses_not_stored_{result}"] += 1

    async def _stored_response(
        self, namespace: str, response_id: str, *, delete: bool = False
    ) -> StoredResponse:
        """The stored response (taken out of the store with `delete`), or a 404."""
        found = None
        if self._store is not None:
            op = self._store.delete_response if delete else self._store.get_response
            found = await op(scoped(namespace, response_id))
        if found is None:
            raise NotFound(f"No response with id '{response_id}'.", param="response_id")
        return found

    async def _delete_response(self, namespace: str, response_id: str) -> dict:
        found = await self._stored_response(namespace, response_id, delete=True)
        if found.continued_by is None and self._store is not None:  # found: a store answered
            # The latest of its chain: its conversation's pinned KV goes with it.
            await self._store.end_session(scoped(namespace, found.session_id))
            await self._turns.memory.flush()
        return {"id": response_id, "object": "response", "deleted": True}
