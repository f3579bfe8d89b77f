"""Turns into OpenAI response bodies: a whole `chat.completion` / `text_completion`, or the
chunks of a stream and their server-sent events. Called by the ingress once per request
with the turn's events (`app.turn.turns.Turns.run`); tool calls and reasoning come from vLLM's
parsers (`app.api.chat_output`). Adds the `kvturn` extension (session, reuse, timings).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.api import chat_output
from app.errors import error_body
from app.turn.model import Delta, TurnInput, TurnResult


def usage(result: TurnResult) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def reuse(result: TurnResult) -> dict:
    """Extension field: the session (send it back as the session header) and how the
    turn reused KV."""
    return {
        "session_id": result.session_id,
        "decode_replica": result.decode_replica,
        "reused_from_decode": result.reused_from_decode,
        "miss_reason": result.miss_reason,
        "spliced": result.spliced,
        "placement": result.placement,
        "timings": result.timings,
    }


async def sse(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Server-sent events of the chunks; an error after the stream started is an
    OpenAI-style error event, then `[DONE]`."""
    try:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as exc:  # headers are sent: report the error in-stream
        yield f"data: {json.dumps(error_body(exc)[1])}\n\n"
    yield "data: [DONE]\n\n"


class ResponseShaper:
    """One per ingress replica: the served model's name and whether tool calls are parsed
    without a named tool choice (`OutputParsers.auto_tools`)."""

    def __init__(self, model_name: str, auto_tools: bool, compact_json: bool = False):
        self._model = model_name
        self._auto_tools = auto_tools
        self._compact = compact_json

    def response(
        self,
        kind: str,
        body,
        turn: TurnInput,
        parser,
        text: str,
        token_ids: list[int],
        logprobs,
        result: TurnResult,
    ) -> dict[str, Any]:
        """The body of a turn that does not stream."""
        choice: dict[str, Any]
        if kind == "chat.completion":
            message, called = chat_output.chat_message(
                parser, self._auto_tools, body, text, token_ids, self._compact
            )
            reason = chat_output.finish_reason(result.finish_reason, called)
            choice = {
                "index": 0,
                "message": message,
                "finish_reason": reason,
                "logprobs": chat_output.chat_logprobs(logprobs),
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": result.finish_reason,
                "logprobs": chat_output.completion_logprobs(logprobs),
            }
        response = {
            "id": turn.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": self._model,
            "choices": [choice],
            "usage": usage(result),
            "kvturn": reuse(result),
        }
        if body.return_token_ids:
            choice["token_ids"] = token_ids
            response["prompt_token_ids"] = list(result.prompt_token_ids)
        return response

    async def chunks(
        self, kind: str, body, turn: TurnInput, parser, events, record: Callable[[TurnResult], None]
    ) -> AsyncIterator[dict]:
        """The chunks of a streamed turn from its `events`; `record` is called with the
        result before the last chunks. The first event is awaited before the first chunk."""
        chat = kind == "chat.completion"
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        stream = chat_output.ChatStream(parser, body, turn.prompt_ids, self._compact) if chat else None

        def envelope(choices: list, **extra) -> dict:
            return {
                "id": turn.request_id,
                "object": chunk_kind,
                "created": created,
                "model": self._model,
                "choices": choices,
                **extra,
            }

        first = await anext(events)
        if chat:
            yield envelope(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
            )
        offset = 0

        async def all_events():
            yield first
            async for event in events:
                yield event

        async for event in all_events():
            if isinstance(event, Delta):
                if stream is not None:
                    delta = stream.delta(event.text, event.token_ids)
                    if delta is None and not event.logprobs and not body.return_token_ids:
                        continue
                    choice = {"index": 0, "delta": delta or {}, "finish_reason": None}
                    if event.logprobs is not None:
                        choice["logprobs"] = chat_output.chat_logprobs(event.logprobs)
                else:
                    choice = {"index": 0, "text": event.text, "finish_reason": None}
                    if event.logprobs is not None:
                        choice["logprobs"] = chat_output.completion_logprobs(event.logprobs, offset)
                    offset += len(event.text)
                if body.return_token_ids:
                    choice["token_ids"] = list(event.token_ids)
                yield envelope([choice])
                continue
            record(event)
            if stream is not None:
                tail = stream.delta("", (), finished=True)
                if tail:
                    yield envelope([{"index": 0, "delta": tail, "finish_reason": None}])
                last = {
                    "index": 0,
                    "delta": {},
                    "finish_reason": chat_output.finish_reason(event.finish_reason, stream.called_tools),
                }
            else:
                last = {"index": 0, "text": "", "finish_reason": event.finish_reason}
            extra = {"prompt_token_ids": list(event.prompt_token_ids)} if body.return_token_ids else {}
            yield envelope([last], kvturn=reuse(event), **extra)
            if body.include_usage:
                yield envelope([], usage=usage(event))
