"""OpenAI's Responses API (`/v1/responses`, the handle methods `responses`,
`responses_stream`): a request becomes a chat turn over the conversation its
`previous_response_id` names (`app.api.response_chain`), and its answer a response or
the Responses event sequence (`app.api.responses_api`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.api import responses_api
from app.api.auth import Tenant
from app.api.response_chain import ResponseChain, ResponseTurn
from app.api.serving import TurnServing, chained, outliving
from app.errors import error_body
from app.turn.events import TurnCount


class ResponsesServing:
    def __init__(self, serving: TurnServing, chain: ResponseChain):
        self._serving = serving
        self.chain = chain

    async def respond(
        self, data: dict[str, Any], session_id: str | None, tenant: Tenant, stream: bool | None = None
    ) -> dict | AsyncIterator[dict]:
        """The response, stored for its chain before it is returned; or its events when it
        streams (the first is in), `response.completed` once stored."""
        streams = bool(data.get("stream")) if stream is None else stream
        turn = await self._turn(data, session_id, tenant, stream=streams)
        if streams:
            events = self._events(turn)
            return chained(await anext(events), events)
        try:
            chat = await self._serving.collect("chat.completion", turn.body, turn.prepared)
            choice = chat["choices"][0]
            response = responses_api.body(
                turn.request,
                turn.prepared.turn.sampling.params,
                self._serving.cfg.model_name,
                chat["created"],
                responses_api.output_items(turn.request, choice["message"]),
                choice["finish_reason"],
                chat["usage"],
                chat["kvturn"],
            )
            await outliving(self.chain.keep(turn, response))
        except BaseException:
            await outliving(self.chain.release(turn))
            raise
        return response

    async def _turn(
        self, data: dict[str, Any], session_id: str | None, tenant: Tenant, *, stream: bool
    ) -> ResponseTurn:
        """Parse a Responses request, resolve the response it continues (its session, or
        a new one for a fork), and prepare its turn. A continuation it owns is given back
        if anything fails before its own response is stored."""
        request = responses_api.parse(data)
        self._serving.check_model(request.model)
        left_out = responses_api.hosted_tools(data)
        if left_out:
            self._serving.turns.counts[TurnCount.HOSTED_TOOLS_LEFT_OUT] += len(left_out)
        previous, owner = None, False
        if request.previous_response_id is not None:
            previous, owner = await self.chain.continue_(tenant.namespace, request)
            # The first to continue a response carries on its session and KV; a fork
            # starts a session of its own (it reuses what the engines' caches still hold).
            session_id = previous.session_id if owner else uuid.uuid4().hex
        turn = ResponseTurn(request, tenant, previous, owner)
        try:
            history = previous.messages if previous is not None else None
            turn.messages = responses_api.chat_messages(request, history)
            turn.body = responses_api.chat_request(request, turn.messages)
            turn.prepared = await self._serving.prepare(
                turn.body, session_id, tenant, stream=stream, request_id=request.request_id
            )
        except BaseException:
            await outliving(self.chain.release(turn))
            raise
        return turn

    async def _events(self, turn: ResponseTurn) -> AsyncIterator[dict]:
        kept = False
        try:
            chunks = self._serving.chunks("chat.completion", turn.body, turn.prepared)
            first = await anext(chunks)
            stream = responses_api.EventStream(
                turn.request, turn.prepared.turn.sampling.params, self._serving.cfg.model_name
            )

            async def keep(response: dict) -> None:
                nonlocal kept
                await outliving(self.chain.keep(turn, response))
                kept = True

            async for event in events(stream, chained(first, chunks), keep):
                yield event
        finally:
            if not kept:
                await outliving(self.chain.release(turn))

    @staticmethod
    def headers(result: dict) -> None:
        return None

    @staticmethod
    async def sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Responses stream events as server-sent events named by their type."""
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    @staticmethod
    def handle_event(event: dict) -> dict:
        return event


async def events(
    stream: responses_api.EventStream,
    chunks: AsyncIterator[dict[str, Any]],
    store: Callable[[dict[str, Any]], Any],
) -> AsyncIterator[dict[str, Any]]:
    """The whole event sequence from our chat chunks (the usage chunk included).
    `response.completed` goes out only once the chunks are exhausted (the turn has
    stored its KV handle) and `store` has kept the response: a client that continues
    the chain as soon as it reads `completed` finds both, and one that hangs up then
    cuts nothing short."""
    for event in stream.opening():
        yield event
    finish, kvturn, response = None, None, None
    try:
        async for chunk in chunks:
            for choice in chunk.get("choices") or []:
                for event in stream.delta(choice.get("delta") or {}):
                    yield event
                finish = choice.get("finish_reason") or finish
            kvturn = chunk.get("kvturn", kvturn)
            if chunk.get("usage"):
                closing, response = stream.closing(finish or "stop", chunk["usage"], kvturn)
                for event in closing:
                    yield event
        if response is None:
            raise RuntimeError("the answer ended without its usage")
        await store(response)
        yield stream.completed(response)
    except Exception as exc:  # the stream started: the failure is an event
        _, error = error_body(exc)
        yield stream.failed(error["error"])
