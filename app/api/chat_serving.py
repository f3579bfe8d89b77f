"""Chat Completions and Completions (`/v1/chat/completions`, `/v1/completions`, and the
handle methods `chat`, `chat_stream`, `completions`, `completions_stream`): the body is
vLLM's request model (`app.api.protocol`) and runs as one turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from app.api.auth import Tenant
from app.api.protocol import ChatCompletionRequest, CompletionRequest
from app.api.serving import TurnServing, chained
from app.api.shaping import sse


class OpenAIServing:
    """One of the two OpenAI text APIs: `kind` names its bodies (`chat.completion`,
    `text_completion`) and `request` is its vLLM request model."""

    def __init__(
        self, serving: TurnServing, request: type[ChatCompletionRequest | CompletionRequest], kind: str
    ):
        self._serving = serving
        self._request = request
        self._kind = kind

    async def respond(
        self, data: dict[str, Any], session_id: str | None, tenant: Tenant, stream: bool | None = None
    ) -> dict | AsyncIterator[dict]:
        """The answer's body, or its chunks when it streams (`stream`: None, as the body
        says; handle callers choose by method). A stream's first chunk is already in, so
        errors before the answer starts are raised here, not in-stream."""
        body = self._request.model_validate(data)
        streams = bool(body.stream) if stream is None else stream
        prepared = await self._serving.prepare(body, session_id, tenant, stream=streams)
        if not streams:
            return await self._serving.collect(self._kind, body, prepared)
        chunks = self._serving.chunks(self._kind, body, prepared)
        return chained(await anext(chunks), chunks)

    def headers(self, result: dict) -> dict[str, str]:
        """An answer's response headers: its session id, to send back with the next turn."""
        return {self._serving.cfg.sessions.session_header: result["kvturn"]["session_id"]}

    @staticmethod
    def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        return sse(chunks)

    @staticmethod
    def handle_event(chunk: dict) -> dict:
        return chunk
