"""The Ingress deployment: the OpenAI- and Anthropic-compatible HTTP API and the Python
handle methods, both made from one table of routes (`ROUTES`).

A route names what it runs: a turn API (`chat`, `completions`, `messages`, `responses`:
one serving class each over the shared `TurnServing`, vLLM's shape) or an operation on
what the app keeps (sessions, stored responses, stats). Every route takes its tenant from
the request's API key in one place (`_tenant`) and maps every error to a body in one place
(`_error_response`: OpenAI's shape, or Anthropic's for the Messages routes). A turn API
route also gives the handle methods `<api>` and `<api>_stream`; an operation route with a
`handle` name gives that method. Clients never reach the engines' transfer machinery.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api import messages_api, metrics, openai_api
from app.api.auth import ApiKeys, Tenant
from app.api.chat_serving import OpenAIServing
from app.api.messages_serving import MessagesServing
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.quotas import Quotas
from app.api.response_chain import ResponseChain
from app.api.responses_serving import ResponsesServing
from app.api.serving import TurnServing
from app.api.tokenizer import HFTokenizer
from app.config import AppConfig
from app.engines.wire import ReplicaQuery
from app.errors import APIError, NotFound, as_api_error, error_body
from app.fleet.clients import ServeEngineClients, store_settings
from app.fleet.routing import LiveReplicas
from app.turn.turns import Turns
from connector.client import StoreClient
from connector.store_api import StoreUnavailable

logger = logging.getLogger("ray.serve").getChild(__name__)
api = FastAPI(title="kvturn", description="OpenAI-compatible multi-turn P/D serving")


class TurnAPI(Protocol):
    """What a turn API's serving class offers the routes."""

    async def respond(
        self, data: dict, session_id: str | None, tenant: Tenant, stream: bool | None = None
    ) -> dict | AsyncIterator[Any]:
        """The answer's body, or its stream events with the first already in (`stream`:
        None, as the body says)."""
        ...

    def headers(self, result: dict) -> dict[str, str] | None: ...

    def sse(self, events: AsyncIterator[Any]) -> AsyncIterator[str]:
        """The stream's server-sent events (HTTP)."""
        ...

    def handle_event(self, event: Any) -> dict:
        """One stream event as a handle caller gets it."""
        ...


Op = Callable[["Ingress", Tenant, Any], Awaitable[Any]]


@dataclass(frozen=True)
class Route:
    verb: str
    path: str
    name: str
    """The endpoint's name (and its handle method's, for a turn API: `name`, `name_stream`)."""
    turn_api: str | None = None
    """Runs a turn of this API (`Ingress._apis`); else `op`."""
    op: Op | None = None
    """(ingress, tenant, the path parameter `arg`) -> the response body."""
    arg: str | None = None
    handle: bool = False
    """A handle method of the route's name runs `op` too (its first argument is `arg`)."""
    anthropic: bool = False
    """The API key may come as `x-api-key`, and errors take Anthropic's shape."""


async def _models(ingress: Ingress, tenant: Tenant, _: Any) -> dict:
    model = {"id": ingress._cfg.model_name, "object": "model", "created": 0, "owned_by": "kvturn"}
    return {"object": "list", "data": [model]}


async def _count_tokens(ingress: Ingress, tenant: Tenant, request: Request) -> dict:
    return await ingress._messages.count_tokens(await ingress._body(request))


async def _end_session(ingress: Ingress, tenant: Tenant, session_id: str) -> dict:
    """End a conversation now: the store forgets it and its decode engine frees the blocks
    pinned for the next turn at once (not at `decoder_kv_blocks_ttl`); a later turn with
    the same id starts a new one. 404 if no such session is kept."""
    return await ingress._serving.end_session(tenant.namespace, session_id)


async def _get_response(ingress: Ingress, tenant: Tenant, response_id: str) -> dict:
    return (await ingress._chain.get(tenant.namespace, response_id)).body


async def _input_items(ingress: Ingress, tenant: Tenant, response_id: str) -> dict:
    return await ingress._chain.input_items(tenant.namespace, response_id)


async def _delete_response(ingress: Ingress, tenant: Tenant, response_id: str) -> dict:
    """Forget a stored response; if no response continued it yet, its conversation's
    pinned KV is freed too, as ending its session does."""
    return await ingress._chain.delete(tenant.namespace, response_id)


async def _kv_stats(ingress: Ingress, tenant: Tenant, _: Any) -> dict:
    """Reuse counters: this ingress replica's turns, the handle store, the engines. 404
    when `access.expose_kv_stats` is off. With API keys, the store's per-tenant figures
    show the caller's own tenant only."""
    if not ingress._cfg.access.expose_kv_stats:
        raise NotFound("Not Found")
    stats = await ingress.stats()
    refused = ingress._quotas.refused.items()
    if not ingress._keys.enabled:
        stats["quota_refusals"] = {f"{t}/{q}": n for (t, q), n in refused}
        return stats
    for shard in (stats.get("store") or {}).get("shards", []):
        own = (shard.get("tenants") or {}).get(tenant.namespace)
        shard["tenants"] = {tenant.namespace: own} if own else {}
        responses = shard.get("responses") or {}
        kept = (responses.get("response_tenants") or {}).get(tenant.namespace)
        responses["response_tenants"] = {tenant.namespace: kept} if kept else {}
    stats["quota_refusals"] = {q: n for (t, q), n in refused if t == tenant.label}
    return stats


_RESPONSE = "/v1/responses/{response_id}"
_SESSION = "/v1/sessions/{session_id}"
ROUTES = (
    Route("GET", "/v1/models", "models", op=_models),
    Route("POST", "/v1/chat/completions", "chat", turn_api="chat"),
    Route("POST", "/v1/completions", "completions", turn_api="completions"),
    Route("POST", "/v1/messages", "messages", turn_api="messages", anthropic=True),
    Route("POST", "/v1/messages/count_tokens", "count_tokens", op=_count_tokens, anthropic=True),
    Route("POST", "/v1/responses", "responses", turn_api="responses"),
    Route("GET", _RESPONSE, "get_response", op=_get_response, arg="response_id", handle=True),
    Route("GET", _RESPONSE + "/input_items", "input_items", op=_input_items, arg="response_id"),
    Route("DELETE", _RESPONSE, "delete_response", op=_delete_response, arg="response_id", handle=True),
    Route("DELETE", _SESSION, "end_session", op=_end_session, arg="session_id", handle=True),
    Route("GET", "/v1/kv/stats", "kv_stats", op=_kv_stats),
)  # fmt: skip


def _error_response(exc: BaseException, anthropic: bool = False) -> JSONResponse:
    """Every error as a body with its status: OpenAI's `{"error": {...}}`, or Anthropic's."""
    status, body = (messages_api.error_shape if anthropic else error_body)(exc)
    headers = getattr(exc, "headers", None) if isinstance(exc, (StarletteHTTPException, APIError)) else None
    return JSONResponse(body, status_code=status, headers=headers)


# Errors FastAPI raises before a route runs (bad JSON, 404 / 405): OpenAI's shape too.
api.add_exception_handler(RequestValidationError, lambda request, exc: _error_response(exc))
api.add_exception_handler(StarletteHTTPException, lambda request, exc: _error_response(exc))


def _caller_errors(method: Callable) -> Callable:
    """A handle method's one error path: whatever fails reaches a `DeploymentHandle`
    caller as the `APIError` an HTTP client would get as a body (status, type, code),
    without its cause (a library's exception need not pickle across Ray; the unexpected
    ones are logged by `error_body`)."""
    if inspect.isasyncgenfunction(method):

        async def stream(*args, **kwargs):
            try:
                async for item in method(*args, **kwargs):
                    yield item
            except APIError:
                raise
            except Exception as exc:
                raise as_api_error(exc) from None

        return functools.wraps(method)(stream)

    async def call(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except APIError:
            raise
        except Exception as exc:
            raise as_api_error(exc) from None

    return functools.wraps(method)(call)


def _endpoint(route: Route) -> Callable:
    """The HTTP endpoint of `route`: tenant, then the turn or the operation, errors in
    the route's shape."""

    async def endpoint(self, request: Request):
        try:
            tenant = self._tenant(request, route)
            if route.turn_api is not None:
                return await self._http_turn(self._apis[route.turn_api], request, tenant)
            assert route.op is not None
            arg = request.path_params[route.arg] if route.arg else request
            return await route.op(self, tenant, arg)
        except Exception as exc:
            return _error_response(exc, route.anthropic)

    endpoint.__name__ = "http_" + route.name
    endpoint.__qualname__ = "Ingress." + endpoint.__name__  # Serve binds class routes by name
    return endpoint


def _turn_methods(name: str) -> tuple[Callable, Callable]:
    """The handle methods of a turn API: its answer, and its stream events
    (`handle.options(stream=True)`); `body` is the API's request body as a dict."""

    async def call(
        self: Ingress, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> dict:
        openai_api.check_json_values(body)
        out = await self._apis[name].respond(
            body, session_id, self._keys.handle_tenant(api_key), stream=False
        )
        assert isinstance(out, dict)
        return out

    async def stream(
        self: Ingress, body: dict, session_id: str | None = None, api_key: str | None = None
    ) -> AsyncIterator[dict]:
        openai_api.check_json_values(body)
        serving = self._apis[name]
        events = await serving.respond(body, session_id, self._keys.handle_tenant(api_key), stream=True)
        assert not isinstance(events, dict)
        async for event in events:
            yield serving.handle_event(event)

    call.__name__, stream.__name__ = name, name + "_stream"
    return _caller_errors(call), _caller_errors(stream)


def _op_method(route: Route) -> Callable:
    async def method(self: Ingress, arg: str, api_key: str | None = None) -> dict:
        assert route.op is not None
        return await route.op(self, self._keys.handle_tenant(api_key), arg)

    method.__name__ = method.__qualname__ = route.name
    method.__doc__ = route.op.__doc__ if route.op is not None else None
    return _caller_errors(method)


class Ingress:
    """HTTP routes and handle methods (both from `ROUTES`). Handle callers are trusted
    (`app.api.auth`); `api_key` makes them that key's tenant.

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
        self._store = StoreClient.of_deployment(store, store_settings(cfg)) if store is not None else None
        self._keys = ApiKeys.of(cfg.access)
        self._quotas = Quotas(ingress_replicas)
        app_name = serve.get_replica_context().app_name
        prefill_live = LiveReplicas(app_name, "PrefillServer") if cfg.prefill_hosts else None
        clients = ServeEngineClients(prefill, decode, LiveReplicas(app_name, "DecodeServer"), prefill_live)
        timed_store = metrics.TimedStore(self._store) if self._store is not None else None
        tokenizer = HFTokenizer(cfg.tokenizer or cfg.model)
        self._turns = Turns(cfg, clients, timed_store, tokenizer)
        self._serving = TurnServing(cfg, self._turns, tokenizer, self._store, self._quotas)
        self._chain = ResponseChain(self._store, self._turns)
        self._messages = MessagesServing(self._serving)
        self._apis: dict[str, TurnAPI] = {
            "chat": OpenAIServing(self._serving, ChatCompletionRequest, "chat.completion"),
            "completions": OpenAIServing(self._serving, CompletionRequest, "text_completion"),
            "messages": self._messages,
            "responses": ResponsesServing(self._serving, self._chain),
        }

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

    async def stats(self) -> dict:
        """This replica's turn counters and the store's figures (handle method too)."""
        out: dict[str, Any] = {"turns": {str(k): v for k, v in self._turns.counts.items()}}
        if self._store is not None:
            try:
                out["store"] = await self._store.stats()
            except StoreUnavailable as exc:  # restarting or redeploying: say so, don't fail
                out["store"] = {"unavailable": str(exc)}
        return out

    def _tenant(self, request: Request, route: Route) -> Tenant:
        headers = request.headers
        return self._keys.tenant(
            messages_api.authorization(headers) if route.anthropic else headers.get("authorization")
        )

    async def _body(self, request: Request) -> dict:
        return await openai_api.read_body(request, self._cfg.openai.max_request_bytes)

    def _session_header(self, request: Request) -> str | None:
        header = self._cfg.sessions.session_header
        session_id = request.headers.get(header)
        limit = self._cfg.openai.max_session_id_chars
        if session_id is not None and not 0 < len(session_id) <= limit:
            raise APIError(400, f"the session id must have 1 to {limit} characters", param=header)
        return session_id

    async def _http_turn(self, serving: TurnAPI, request: Request, tenant: Tenant):
        """A turn over HTTP: its body (with its session header), or its server-sent
        events. Everything knowable before the first byte (bad input, context length, the
        engine refusing the request) answers with its status, not in-stream."""
        session_id = self._session_header(request)
        out = await serving.respond(await self._body(request), session_id, tenant)
        if isinstance(out, dict):
            return JSONResponse(out, headers=serving.headers(out))
        return StreamingResponse(serving.sse(out), media_type="text/event-stream")


for _route in ROUTES:
    api.add_api_route(_route.path, _endpoint(_route), methods=[_route.verb], name=_route.name)
    if _route.turn_api is not None:
        for _method in _turn_methods(_route.turn_api):
            setattr(Ingress, _method.__name__, _method)
    elif _route.handle:
        setattr(Ingress, _route.name, _op_method(_route))

Ingress = serve.deployment(name="Ingress")(serve.ingress(api)(Ingress))  # type: ignore[misc]
