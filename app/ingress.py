"""The ingress deployment: OpenAI-compatible HTTP API and Python handle methods.

It renders chat prompts, runs each turn through `app.turns.Turns`, and turns events into
OpenAI response bodies (streaming SSE or not). Errors become OpenAI-style bodies in one
place (`_error_response`); clients never reach the engines' transfer machinery.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app import metrics
from app.auth import ApiKeys, scoped
from app.config import AppConfig
from app.engine import EngineChunk, EngineRequest, ReplicaQuery, Sampling
from app.protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.routing import LiveReplicas
from app.turns import Delta, TurnInput, TurnResult, Turns
from connector.actor import StoreClient, StoreSettings

logger = logging.getLogger("ray.serve")
api = FastAPI(title="kvturn", description="OpenAI-compatible multi-turn P/D serving")


def _error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, APIError):
        return JSONResponse(exc.body(), status_code=exc.status)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON"))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        return _error_response(APIError(400, message, param=".".join(loc) or None))
    logger.exception("internal error")
    return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)


api.add_exception_handler(APIError, lambda request, exc: _error_response(exc))
api.add_exception_handler(RequestValidationError, lambda request, exc: _error_response(exc))


class _HFTokenizer:
    def __init__(self, name: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(name)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render(self, messages: list[dict], tools: list[dict] | None) -> str:
        try:
            return self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # template errors are the client's messages' fault
            raise APIError(400, f"messages could not be rendered by the chat template: {exc}", param="messages")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)


class ServeEngineClients:
    """`EngineClients` over Serve deployment handles."""

    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle, decode_live: LiveReplicas):
        self._prefill = prefill
        self._decode = decode.options(stream=True)
        self._decode_calls = decode
        self._decode_live = decode_live

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]:
        return await self._prefill.prefill.remote(request)

    async def decode(self, request: EngineRequest):
        async for item in self._decode.generate.remote(request):
            yield item

    def decode_alive(self, replica_id: str) -> bool | None:
        return self._decode_live.alive(replica_id)

    async def decode_kv_blocks(self, replica_id: str) -> dict | None:
        return await self._decode_calls.kv_blocks.remote(ReplicaQuery(replica_id))

    async def release(self, replica_id: str, request_ids) -> list[str]:
        return await self._decode_calls.release.remote(ReplicaQuery(replica_id), list(request_ids))


def store_settings(cfg: AppConfig) -> StoreSettings:
    """The handle store's settings for a config (the builder binds `SessionStore` with
    them; the ingress checks the running store has them)."""
    s = cfg.sessions
    return StoreSettings(
        handle_ttl_s=s.handle_ttl_s,
        decoder_ttl_s=cfg.transfer.decoder_kv_blocks_ttl_s,
        max_sessions=s.max_sessions,
        max_blocks_per_engine=s.max_pinned_blocks_per_engine,
        index_block_size=cfg.block_size,
        shards=s.store_shards,
    )


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
    ):
        self._cfg = cfg
        self._prefill = prefill
        self._decode = decode
        self._tok = _HFTokenizer(cfg.tokenizer or cfg.model)
        self._store = StoreClient.of_deployment(store, store_settings(cfg)) if store is not None else None
        store = self._store
        app_name = serve.get_replica_context().app_name
        self._keys = ApiKeys(cfg.access.api_keys)
        self._metrics = metrics.TurnMetrics(cfg.mode.value)
        timed_store = metrics.TimedStore(store) if store is not None else None
        self._turns = Turns(cfg, ServeEngineClients(prefill, decode, LiveReplicas(app_name, "DecodeServer")), timed_store, self._tok)

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
        waiting = [role for role, r in zip(engines, results) if isinstance(r, BaseException)]
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

    @api.get("/v1/kv/stats")
    async def kv_stats(self, request: Request):
        """Reuse counters: this ingress replica's turns, the handle store, the engines.
        404 when `access.expose_kv_stats` is off."""
        try:
            self._keys.namespace(request.headers.get("authorization"))
            if not self._cfg.access.expose_kv_stats:
                raise APIError(404, "Not Found", type="NotFoundError")
        except APIError as exc:
            return _error_response(exc)
        return await self.stats()

    async def _http(self, request: Request, model_cls, events, kind: str):
        try:
            namespace = self._keys.namespace(request.headers.get("authorization"))
            raw = await request.body()
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise APIError(400, "the request body is not valid JSON")
            if not isinstance(data, dict):
                raise APIError(400, "the request body must be a JSON object")
            body = model_cls.model_validate(data)
            session_id = request.headers.get(self._cfg.sessions.session_header)
            turn = self._prepare(body, session_id, events, namespace)
            if body.stream:
                return StreamingResponse(self._sse(kind, body, turn), media_type="text/event-stream")
            result = await self._collect(kind, body, turn)
            return JSONResponse(result, headers={self._cfg.sessions.session_header: result["kvturn"]["session_id"]})
        except Exception as exc:
            return _error_response(exc)

    # -- handle methods -----------------------------------------------------------------

    # Handle callers are trusted (`app.auth`); `api_key` makes them that key's tenant.

    async def chat(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> dict:
        """Non-streaming chat completion for `DeploymentHandle` callers. Raises APIError."""
        return await self._call(ChatCompletionRequest, self._chat_events, "chat.completion", body, session_id, api_key)

    async def chat_stream(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> AsyncIterator[dict]:
        """Streaming chat completion chunks (use `handle.options(stream=True)`)."""
        async for chunk in self._call_stream(ChatCompletionRequest, self._chat_events, "chat.completion", body, session_id, api_key):
            yield chunk

    async def completions(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> dict:
        return await self._call(CompletionRequest, self._completion_events, "text_completion", body, session_id, api_key)

    async def completions_stream(self, body: dict, session_id: str | None = None, api_key: str | None = None) -> AsyncIterator[dict]:
        async for chunk in self._call_stream(CompletionRequest, self._completion_events, "text_completion", body, session_id, api_key):
            yield chunk

    async def end_session(self, session_id: str, api_key: str | None = None) -> dict:
        """End a conversation for `DeploymentHandle` callers: the store forgets it and its
        decode engine frees the blocks it pinned for the next turn at once (not at
        `decoder_kv_blocks_ttl`). A later turn with the same id starts a new conversation.
        Raises `APIError` 404 if no such session is kept (unknown, already ended, evicted)."""
        return await self._end_session(scoped(self._keys.handle_namespace(api_key), session_id), session_id)

    async def _end_session(self, key: str, session_id: str) -> dict:
        if self._store is None:
            raise APIError(400, "this deployment keeps no sessions (mode=oneway)", param="session_id")
        if not await self._store.end_session(key):
            raise APIError(404, f"No session '{session_id}'.", type="NotFoundError", param="session_id", code="session_not_found")
        await self._turns.memory.flush()
        return {"id": session_id, "object": "session", "deleted": True}

    async def stats(self) -> dict:
        out: dict[str, Any] = {"turns": dict(self._turns.counts)}
        if self._store is not None:
            out["store"] = await self._store.stats()
        return out

    async def _call(self, model_cls, events, kind, body, session_id, api_key=None):
        namespace = self._keys.handle_namespace(api_key)
        parsed = self._validate(model_cls, body)
        turn = self._prepare(parsed, session_id, events, namespace)
        return await self._collect(kind, parsed, turn)

    async def _call_stream(self, model_cls, events, kind, body, session_id, api_key=None):
        namespace = self._keys.handle_namespace(api_key)
        parsed = self._validate(model_cls, body)
        turn = self._prepare(parsed, session_id, events, namespace)
        async for chunk in self._chunks(kind, parsed, turn):
            yield chunk

    @staticmethod
    def _validate(model_cls, body: dict):
        try:
            return model_cls.model_validate(body)
        except ValidationError as exc:
            response = _error_response(exc)
            raise APIError(response.status_code, json.loads(response.body)["error"]["message"])

    # -- turns -> OpenAI bodies ---------------------------------------------------------

    def _prepare(self, body, session_id: str | None, events, namespace: str = "") -> TurnInput:
        if body.model != self._cfg.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist.", type="NotFoundError", param="model", code="model_not_found")
        text, ids = events(body)
        if ids is not None and any(t < 0 or t >= self._tok.vocab_size for t in ids):
            raise APIError(400, "prompt token ids out of the vocabulary's range", param="prompt")
        limit = body.answer_limit
        sampling = Sampling(
            max_tokens=limit or self._cfg.default_max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=body.stop_list,
            ignore_eos=body.ignore_eos,
        )
        turn = TurnInput(
            request_id=("chatcmpl-" if isinstance(body, ChatCompletionRequest) else "cmpl-") + uuid.uuid4().hex,
            sampling=sampling,
            session_id=scoped(namespace, session_id),
            namespace=namespace,
            prompt_text=text,
            prompt_ids=ids,
            max_tokens_given=limit is not None,
        )
        return turn

    def _chat_events(self, body: ChatCompletionRequest):
        try:
            messages = [m.for_template() for m in body.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages")
        return self._tok.render(messages, body.tools), None

    def _completion_events(self, body: CompletionRequest):
        return body.prompt_text_or_ids()

    def _record_turn(self, result: TurnResult, body) -> None:
        """Metrics of a finished turn (`app.metrics`); starts the metrics poll. Never
        raises: metrics must not fail an answer."""
        try:
            index = metrics.chat_turn_index(body.messages) if isinstance(body, ChatCompletionRequest) else None
            self._metrics.record_turn(result, index)
            self._metrics.sync_events(self._turns.counts)
            self._metrics.ensure_polling(self._turns.counts, self._store.stats if self._store is not None else None)
        except Exception:
            logger.exception("turn metrics failed")

    @staticmethod
    def _usage(result: TurnResult) -> dict:
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        }

    @staticmethod
    def _reuse(result: TurnResult) -> dict:
        """Extension field: the session (send it back as the session header) and how the
        turn reused KV."""
        return {
            "session_id": result.session_id,
            "decode_replica": result.decode_replica,
            "reused_from_decode": result.reused_from_decode,
            "miss_reason": result.miss_reason,
            "spliced": result.spliced,
            "timings": result.timings,
        }

    async def _collect(self, kind: str, body, turn: TurnInput) -> dict:
        texts: list[str] = []
        token_ids: list[int] = []
        result = None
        async for event in self._turns.run(turn):
            if isinstance(event, Delta):
                texts.append(event.text)
                token_ids.extend(event.token_ids)
            else:
                result = event
        self._record_turn(result, body)
        text = "".join(texts)
        if kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": result.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": None}
        response = {
            "id": turn.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self._cfg.model_name,
            "choices": [choice],
            "usage": self._usage(result),
            "kvturn": self._reuse(result),
        }
        if body.return_token_ids:
            choice["token_ids"] = token_ids
            response["prompt_token_ids"] = list(result.prompt_token_ids)
        return response

    async def _chunks(self, kind: str, body, turn: TurnInput) -> AsyncIterator[dict]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        created = int(time.time())

        def envelope(choices: list, **extra) -> dict:
            return {"id": turn.request_id, "object": chunk_kind, "created": created, "model": self._cfg.model_name, "choices": choices, **extra}

        if kind == "chat.completion":
            yield envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async for event in self._turns.run(turn):
            if isinstance(event, Delta):
                if kind == "chat.completion":
                    choice = {"index": 0, "delta": {"content": event.text}, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": event.text, "finish_reason": None}
                if body.return_token_ids:
                    choice["token_ids"] = list(event.token_ids)
                yield envelope([choice])
                continue
            self._record_turn(event, body)
            last = {"index": 0, "finish_reason": event.finish_reason}
            last.update({"delta": {}} if kind == "chat.completion" else {"text": ""})
            extra = {"prompt_token_ids": list(event.prompt_token_ids)} if body.return_token_ids else {}
            yield envelope([last], kvturn=self._reuse(event), **extra)
            if body.include_usage:
                yield envelope([], usage=self._usage(event))

    async def _sse(self, kind: str, body, turn: TurnInput) -> AsyncIterator[str]:
        try:
            async for chunk in self._chunks(kind, body, turn):
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # headers are sent: report the error in-stream
            yield f"data: {json.dumps(json.loads(_error_response(exc).body))}\n\n"
        yield "data: [DONE]\n\n"
