"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`, the handle
methods `messages`, `messages_stream`): vLLM's converters make the request a chat turn
(`app.api.messages_api`), and its answer or chunks Anthropic's message or events. Errors
keep Anthropic's shape (`messages_api.error_shape`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from app.api import messages_api, sessions
from app.api.auth import Tenant
from app.api.protocol import ChatCompletionRequest
from app.api.serving import TurnServing, chained
from app.turn.model import Delta


class MessagesServing:
    def __init__(self, serving: TurnServing):
        self._serving = serving
        self._merge_inline_system = messages_api.merge_inline_system(serving.tok.hf)

    async def respond(
        self, data: dict[str, Any], session_id: str | None, tenant: Tenant, stream: bool | None = None
    ) -> dict | AsyncIterator[str]:
        """Anthropic's message, or its server-sent events when it streams (the first is
        in: `message_start`, which carries what the turn reused)."""
        body, retain = self._chat_request(data)
        streams = bool(data.get("stream")) if stream is None else stream
        prepared = await self._serving.prepare(body, session_id, tenant, stream=streams, retain=retain)
        if not streams:
            return messages_api.message(await self._serving.collect("chat.completion", body, prepared))
        reused: list[int] = []  # the first delta's count of prompt tokens not computed

        def note(event: Any) -> None:
            if isinstance(event, Delta) and event.cached_tokens is not None and not reused:
                reused.append(event.cached_tokens)

        chunks = self._serving.chunks("chat.completion", body, prepared, note)
        first = await anext(chunks)  # the turn's first event is in: `reused` is known
        prompt_tokens = len(prepared.turn.prompt_ids or ())
        events = messages_api.events(chained(first, chunks), prompt_tokens, reused[0] if reused else None)
        return chained(await anext(events), events)

    async def count_tokens(self, data: dict[str, Any]) -> dict:
        request = messages_api.parse(data, count_tokens=True)
        self._serving.check_model(request.model)
        body = messages_api.chat_request(request, merge_inline_system=self._merge_inline_system)
        text, _, _ = await self._serving.render_chat(body)
        return {"input_tokens": len(await asyncio.to_thread(self._serving.tok.encode, text))}

    def _chat_request(self, data: dict[str, Any]) -> tuple[ChatCompletionRequest, bool]:
        """The chat turn of a Messages request, and whether it asked for long retention."""
        request = messages_api.parse(data)
        self._serving.check_model(request.model)
        body = messages_api.chat_request(request, merge_inline_system=self._merge_inline_system)
        body.prompt_cache_key = sessions.claude_code_session(request.metadata)
        return messages_api.chat_extensions(data, body), messages_api.long_retention(data)

    @staticmethod
    def headers(result: dict) -> None:
        return None

    @staticmethod
    def sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
        return events

    @staticmethod
    def handle_event(event: str) -> dict:
        return messages_api.sse_dict(event)
