"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat
pipeline: Claude-Code-style agents connect unchanged and reuse KV like chat clients do.

vLLM's own Anthropic layer does the protocol work: its request models, its conversion to a
chat request (system blocks, `tool_use` / `tool_result`, tool choice, thinking, stop
sequences) and its conversion of chat output back (`messages_full_converter`, and
`message_stream_converter` for Anthropic's stream events). What this module adds is what a
P/D fleet needs around that: the server-only fields refused, `cache_control` retention
hints read, and errors in
Anthropic's own shape.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from app.api.protocol import FORBIDDEN_FIELDS, ChatCompletionRequest
from app.errors import APIError, error_body

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_shape(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Any error as Anthropic's body: `{"type": "error", "error": {"type", "message"}}`."""
    status, body = error_body(exc)
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def _converter():
    """vLLM's Anthropic serving class, for its converters alone (they use no engine state)."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return AnthropicServingMessages


def refuse_server_fields(data: dict[str, Any]) -> None:
    for name in FORBIDDEN_FIELDS:
        if name in data:
            raise APIError(
                400, f"'{name}' is reserved for the server and cannot be set by clients", param=name
            )


def parse(data: dict[str, Any], *, count_tokens: bool = False):
    """The request as vLLM's Anthropic model (`max_tokens` required unless counting)."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest

    refuse_server_fields(data)
    if not count_tokens and "max_tokens" not in data:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    cls = AnthropicCountTokensRequest if count_tokens else AnthropicMessagesRequest
    return cls.model_validate(data)


def long_retention(data: dict[str, Any]) -> bool:
    """Whether any block asks for an hour of caching (`cache_control.ttl == "1h"`)."""
    blocks: list[Any] = []
    if isinstance(data.get("system"), list):
        blocks.extend(data["system"])
    for message in data.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            blocks.extend(message["content"])
    blocks.extend(data.get("tools") or [])
    return any(
        isinstance(b, dict)
        and isinstance(b.get("cache_control"), dict)
        and b["cache_control"].get("ttl") == "1h"
        for b in blocks
    )


def chat_request(request, *, merge_inline_system: bool) -> ChatCompletionRequest:
    """The chat request vLLM's converter makes of a Messages request, as our chat model
    (with its checks)."""
    chat = _converter().to_chat_completion_request(request, merge_inline_system=merge_inline_system)
    body = chat.model_dump(exclude_unset=True, exclude_none=True)
    body.pop("model", None)  # checked by the caller against the served name
    return ChatCompletionRequest.model_validate(body)


def chat_extensions(data: dict[str, Any], body: ChatCompletionRequest) -> ChatCompletionRequest:
    """vLLM's sampling extensions a Messages body may carry (`ignore_eos`, `min_tokens`,
    `seed`, `repetition_penalty`), which vLLM's converter leaves out."""
    for name in ("ignore_eos", "min_tokens", "seed", "repetition_penalty"):
        if name in data:
            setattr(body, name, data[name])
    return body


def _chat_model(data: dict[str, Any], cls):
    """A chat body of ours as vLLM's response model (its converters read those)."""
    return cls.model_validate(_vllm_names(data))


def _vllm_names(data: Any) -> Any:
    """Our `reasoning_content` under vLLM's current name, `reasoning`."""
    if isinstance(data, dict):
        return {("reasoning" if k == "reasoning_content" else k): _vllm_names(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_vllm_names(v) for v in data]
    return data


def message(chat: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic `message` from a whole chat completion of ours (usage: the tokens not
    computed this turn are `cache_read_input_tokens`)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    converter = _converter()
    out = converter.messages_full_converter(_bare(converter), _chat_model(chat, ChatCompletionResponse))
    body = out.model_dump(exclude_none=True, exclude={"kv_transfer_params", "ec_transfer_params"})
    body["id"] = "msg_" + chat["id"].removeprefix("chatcmpl-")
    body["kvturn"] = chat.get("kvturn")
    return body


def _bare(cls):
    """An instance of vLLM's serving class without its engine (its converters need none)."""
    return cls.__new__(cls)


async def events(
    chunks: AsyncIterator[dict[str, Any]], prompt_tokens: int, cached_tokens: int | None = None
) -> AsyncIterator[str]:
    """Anthropic's server-sent events from our chat chunks (which must include the usage
    chunk). `message_start` carries the prompt's size and, with `cached_tokens` (what the
    turn had not to compute, known at its first token), `cache_read_input_tokens`; the
    final split comes with `message_delta`. An error after the stream started ends it
    with Anthropic's `error` event."""
    from vllm.entrypoints.anthropic.serving import wrap_data_with_event

    failed: list[BaseException] = []

    async def feed() -> AsyncIterator[str]:
        first = True
        try:
            async for chunk in chunks:
                chunk = {**chunk, "id": "msg_" + chunk["id"].removeprefix("chatcmpl-")}
                if first:
                    chunk["usage"] = {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": 0,
                        "total_tokens": prompt_tokens,
                    }
                    if cached_tokens is not None:
                        chunk["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
                    first = False
                yield f"data: {json.dumps(_vllm_names(chunk))}\n\n"
        except Exception as exc:  # reported after what was converted so far
            failed.append(exc)
            return
        yield "data: [DONE]\n\n"

    converter = _converter()
    async for event in converter.message_stream_converter(_bare(converter), feed()):
        yield event
    if failed:
        _, body = error_shape(failed[0])
        yield wrap_data_with_event(json.dumps(body), "error")


def merge_inline_system(tokenizer) -> bool:
    """Whether the chat template wants one system message first (vLLM's detection):
    system messages inside `messages` are then merged into it."""
    return bool(_converter()._detect_merge_inline_system(getattr(tokenizer, "chat_template", None)))


def authorization(headers) -> str | None:
    """The API key as `Authorization: Bearer`, or Anthropic's `x-api-key` header."""
    value = headers.get("authorization")
    if value is None and headers.get("x-api-key"):
        value = "Bearer " + headers["x-api-key"]
    return value


def sse_dict(event: str) -> dict[str, Any]:
    """One server-sent event of `events` as the dict a handle caller gets."""
    data = event.split("data: ", 1)[1]
    return json.loads(data)
