"""OpenAI's Responses API (`/v1/responses`) over the chat pipeline, stateful: a
`previous_response_id` names a stored response, and so the session whose KV holds that
exact conversation (no header, no prefix search).

vLLM's own Responses layer does the protocol work: its request and response models, its
conversion of input items to chat messages (`construct_input_messages`), of parsed output
to output items (`build_response_output_items`), and its streaming state machine for the
event sequence (`SimpleStreamingEventProcessor`). What this module adds: the stored
conversation a chain continues (chat messages, tool calls included), the checks an agent's
bad input needs (unknown call ids, items a text model can't read), and the chat request a
response runs as.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from app.api.messages_api import refuse_server_fields
from app.api.protocol import ChatCompletionRequest
from app.errors import APIError, client_error

UNSUPPORTED = {
    "background": "background responses are not supported",
    "conversation": "conversation objects are not supported: chain responses with previous_response_id",
    "prompt": "prompt templates are not supported",
}
TEXT_PARTS = ("input_text", "output_text", "text")
OFFERED_TOOL_TYPES = ("function", "namespace", "custom")


def new_id(parent: str | None = None) -> str:
    """`resp_` + a chain part + a random part. Responses that continue one another share
    the chain part (forks too), so one store shard keeps a whole tree of them and each
    response stores only what it added (`connector.response_store`)."""
    chain = (
        parent[5:21] if parent and parent.startswith("resp_") and len(parent) == 37 else uuid.uuid4().hex[:16]
    )
    return "resp_" + chain + uuid.uuid4().hex[:16]


def parse(data: dict[str, Any]):
    """The request as vLLM's `ResponsesRequest`, with what this server does not do refused."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    refuse_server_fields(data)
    for name, why in UNSUPPORTED.items():
        if data.get(name) not in (None, False):
            raise APIError(400, f"'{name}': {why}", param=name)
    if "input" not in data:
        raise APIError(400, "'input' is required", param="input")
    for i, tool in enumerate(data.get("tools") or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise APIError(400, f"tools.{i}: a tool must be an object with a 'type'", param=f"tools.{i}")
    value = data.get("max_output_tokens")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise APIError(400, "'max_output_tokens' must be an integer of at least 1", param="max_output_tokens")
    request = ResponsesRequest.model_validate(data)
    request.request_id = new_id(request.previous_response_id)
    return request


def hosted_tools(data: dict[str, Any]) -> list[str]:
    """The types of the request's tools that the model is not offered: hosted tools the
    server would run itself (`web_search`, `file_search`, `code_interpreter`, `mcp`, ...).
    The model sees function tools, the functions of `namespace` tools (as
    `<namespace>__<name>`, answered as namespaced `function_call` items) and `custom`
    tools (as a one-string function): vLLM's `get_function_tools` draws that line."""
    return [tool["type"] for tool in data.get("tools") or () if tool.get("type") not in OFFERED_TOOL_TYPES]


def input_items(request) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message), each with an id, for
    storing and listing (`GET /v1/responses/{id}/input_items`)."""
    if isinstance(request.input, str):
        items = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": request.input}]}
        ]
    else:
        items = [dict(i) if isinstance(i, dict) else i.model_dump(exclude_none=True) for i in request.input]
    for item in items:
        item.setdefault("id", "msg_" + uuid.uuid4().hex[:24])
    return items


def chat_messages(request, history: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat messages of the conversation this response answers: the request's
    instructions (they do not carry over a chain), the stored history, the new items."""
    from vllm.entrypoints.openai.responses.utils import construct_input_messages
    from vllm.exceptions import VLLMValidationError

    try:
        messages = construct_input_messages(
            request_instructions=request.instructions, request_input=request.input, prev_msg=history
        )
    except (VLLMValidationError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise client_error(exc) from exc
    out = [_text_message(i, dict(m)) for i, m in enumerate(messages)]
    calls = {c.get("id") for m in out for c in m.get("tool_calls") or []}
    for m in out:
        if m.get("role") == "tool" and m.get("tool_call_id") not in calls:
            raise APIError(
                400,
                f"No tool call found for function call output with call_id {m.get('tool_call_id')!r}.",
                param="input",
            )
    if not out:
        raise APIError(400, "'input' must not be empty", param="input")
    return out


def _text_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """Text parts (`input_text` / `output_text`) as the chat template reads them; other
    parts (images, files, audio) are refused: the model reads text."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise APIError(
                    400,
                    f"input.{index}: content part type {kind!r} is not supported: text only",
                    param="input",
                )
            texts.append(part["text"])
        message["content"] = "".join(texts)
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict) and call.get("function") is not None:
            call["function"] = dict(call["function"])
    return message


def chat_request(request, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a response runs as (same sampling, tools, structured output)."""
    from vllm.entrypoints.openai.responses.utils import construct_tool_dicts

    body: dict[str, Any] = {
        "messages": messages,
        "prompt_cache_key": request.prompt_cache_key,
        "max_completion_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls,
        "stream": bool(request.stream),
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "cache_salt",
        "chat_template_kwargs",
        "ignore_eos",
    ):
        value = getattr(request, name, None)
        if value not in (None, [], {}):
            body[name] = value
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    tools = construct_tool_dicts(request.tools, request.tool_choice)
    if tools:
        body["tools"] = tools
        body["tool_choice"] = _tool_choice(request.tool_choice)
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
        }
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    if request.top_logprobs:
        body["logprobs"] = True
        body["top_logprobs"] = request.top_logprobs
    return ChatCompletionRequest.model_validate(body)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    kind = getattr(choice, "type", None)
    if kind == "function":
        return {"type": "function", "function": {"name": choice.name}}
    raise APIError(400, f"tool_choice of type {kind!r} is not supported", param="tool_choice")


def output_items(request, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Output items of a whole answer (reasoning, message, function calls), keeping the
    chat answer's call ids as the items' `call_id`."""
    from vllm.entrypoints.generate.base.protocol import FunctionCall
    from vllm.entrypoints.openai.responses.utils import build_response_output_items

    calls = [
        FunctionCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in message.get("tool_calls") or []
    ]
    items = build_response_output_items(
        message.get("reasoning_content"), message.get("content"), calls, tools=request.tools
    )
    return [item.model_dump(exclude_none=True) for item in items]


def assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message the output items stand for, as the next turn renders it."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts = _texts(items, "message")
    if texts:
        message["content"] = "".join(texts)
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": _flat_name(item), "arguments": item.get("arguments", "")},
        }
        for item in items
        if item.get("type") == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    reasoning = _texts(items, "reasoning")
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    return message


def _flat_name(item: dict[str, Any]) -> str:
    """A call's function name as the model wrote it (a namespaced call's flat name)."""
    from vllm.tool_parsers.utils import flat_namespace_tool_name

    namespace = item.get("namespace")
    return flat_namespace_tool_name(namespace, item["name"]) if namespace else item["name"]


def _texts(items: list[dict[str, Any]], kind: str) -> list[str]:
    """The text parts of the output items of one type, in order."""
    return [
        part.get("text", "")
        for item in items
        if item.get("type") == kind
        for part in item.get("content") or []
    ]


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def body(
    request,
    params,
    model: str,
    created: int,
    output: list[dict[str, Any]],
    finish_reason: str | None,
    chat_usage: dict[str, Any] | None,
    kvturn: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object (vLLM's `ResponsesResponse`), plus the `kvturn` extension.
    `finish_reason` None: still in progress."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    status = (
        "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    )
    response = ResponsesResponse.from_request(
        request,
        params,
        model_name=model,
        created_time=created,
        output=[],
        status=status,
        usage=None,
    )
    out = response.model_dump(
        mode="json",
        exclude_none=True,
        exclude={"kv_transfer_params", "ec_transfer_params", "input_messages", "output_messages", "metrics"},
    )
    out.update(
        output=output,
        usage=usage(chat_usage) if chat_usage is not None else None,
        error=None,
        store=bool(request.store),
        incomplete_details=out.get("incomplete_details"),
    )
    if kvturn is not None:
        out["kvturn"] = kvturn
    return out


class EventStream:
    """Responses stream events from our chat chunks, through vLLM's state machine:
    `response.created`, `response.in_progress`, the items' `added` / delta / `done`
    events, then `response.completed` (`.incomplete` when cut by max_output_tokens)."""

    def __init__(self, request, params, model: str):
        from vllm.entrypoints.openai.responses.streaming_events import SimpleStreamingEventProcessor

        self._request = request
        self._params = params
        self._model = model
        self._created = int(time.time())
        self._processor = SimpleStreamingEventProcessor(tools=request.tools)
        self._sequence = 0
        self.output: list[dict[str, Any]] = []

    def _event(self, event: Any) -> dict[str, Any]:
        data = event if isinstance(event, dict) else event.model_dump(mode="json", exclude_none=True)
        data["sequence_number"] = self._sequence
        self._sequence += 1
        return data

    def _response(self, finish: str | None, chat_usage=None, kvturn=None) -> dict[str, Any]:
        return body(
            self._request, self._params, self._model, self._created, self.output, finish, chat_usage, kvturn
        )

    def opening(self) -> list[dict[str, Any]]:
        response = self._response(None)
        return [
            self._event({"type": "response.created", "response": response}),
            self._event({"type": "response.in_progress", "response": response}),
        ]

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events of one chat `delta` (content, reasoning, tool calls)."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.responses.streaming_events import split_delta

        message = DeltaMessage.model_validate(
            {
                "content": delta.get("content"),
                "reasoning": delta.get("reasoning_content"),
                "tool_calls": delta.get("tool_calls") or [],
            }
        )
        events: list[Any] = []
        processor = self._processor
        for part in split_delta(message):
            target, call = processor.resolve_target_state(part)
            if target.name == "NONE":
                continue
            if processor.needs_transition(target, call):
                events += processor.close_current()
                events += processor.open(target, call)
            events += processor.emit_delta(part, None)  # type: ignore[arg-type]
        return [self._event(e) for e in events]

    def closing(
        self, finish_reason: str, chat_usage: dict[str, Any], kvturn: dict[str, Any] | None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The last items' `done` events and the final response (not yet its event: the
        caller stores the response first, then sends `completed`)."""
        events = [self._event(e) for e in self._processor.close_current()]
        self.output = [
            item.model_dump(mode="json", exclude_none=True) for item in self._processor.output_items
        ]
        return events, self._response(finish_reason, chat_usage, kvturn)

    def completed(self, response: dict[str, Any]) -> dict[str, Any]:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event({"type": kind, "response": response})

    def failed(self, error: dict[str, Any]) -> dict[str, Any]:
        response = self._response(None)
        response.update(
            status="failed", error={"code": error.get("code") or "server_error", "message": error["message"]}
        )
        return self._event({"type": "response.failed", "response": response})
