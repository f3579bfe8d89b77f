"""OpenAI-compatible request bodies and the API's error type.

The request models are vLLM's own (`vllm.entrypoints.openai`): the same fields, defaults,
validators and `to_sampling_params` as vLLM's OpenAI server. On top of them, the checks
that our P/D orchestration needs or that vLLM leaves to its engine (where a bad value
would only fail after the response started):

* the engines' transfer machinery is the server's: `kv_transfer_params` (and
  `ec_transfer_params`) from a client are refused;
* one choice per request (`n` > 1, beam search and prompt logprobs are refused, naming
  the field);
* values the engine would refuse later: empty stop strings, `max_tokens` < 1, token ids
  outside the vocabulary, `logit_bias` out of range, `top_logprobs` above the limit,
  invalid JSON schemas in `tools` or `response_format`.

Every refusal is an `APIError` (an OpenAI-style `{"error": {...}}` body with its status).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import model_validator
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as _VLLMChatRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as _VLLMCompletionRequest

from app.errors import APIError

FORBIDDEN_FIELDS = ("kv_transfer_params", "ec_transfer_params")
ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = {
    "use_beam_search": "beam search is not supported",
    "prompt_logprobs": "prompt logprobs are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "suffix": "suffix is not supported",
    "continue_final_message": "continue_final_message is not supported",
}


def _refuse_server_fields(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    for name in FORBIDDEN_FIELDS:
        if name in data:
            raise ValueError(f"'{name}' is reserved for the server and cannot be set by clients")
    if (data.get("n") or 1) != 1:
        raise ValueError("'n' must be 1: one choice per request is supported")
    if (data.get("best_of") or 1) != 1:
        raise ValueError("'best_of' must be 1: one choice per request is supported")
    for name, why in UNSUPPORTED.items():
        if data.get(name) not in (None, False, 0, ""):
            raise ValueError(f"'{name}': {why}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = data.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"'{name}' must be an integer of at least 1")
    stop = data.get("stop")
    if stop == "" or (isinstance(stop, list) and any(s == "" for s in stop)):
        raise ValueError("'stop' strings must not be empty")
    bias = data.get("logit_bias")
    if isinstance(bias, dict):
        for key, value in bias.items():
            try:
                int(key)
            except (TypeError, ValueError):
                raise ValueError(f"'logit_bias' keys must be token ids, got {str(key)[:40]!r}") from None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -100 <= value <= 100:
                raise ValueError("'logit_bias' values must be numbers between -100 and 100")
    for tool in data.get("tools") or []:
        params = (
            tool.get("function", {}).get("parameters")
            if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
            else None
        )
        if params is not None:
            _check_schema(params, "tools")
    fmt = data.get("response_format")
    if (
        isinstance(fmt, dict)
        and fmt.get("type") == "json_schema"
        and isinstance(fmt.get("json_schema"), dict)
    ):
        schema = fmt["json_schema"].get("schema", fmt["json_schema"].get("json_schema"))
        if schema is not None:
            _check_schema(schema, "response_format")
    return data


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, dict):
        raise ValueError(f"'{param}': a JSON schema must be an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"'{param}': invalid JSON schema: {exc.message}") from None


class _Checks:
    """What both endpoints check beyond vLLM's models (see the module docstring)."""

    if TYPE_CHECKING:  # fields of the vLLM request models this is mixed into
        stream_options: Any
        stop_token_ids: list[int] | None
        allowed_token_ids: list[int] | None
        logprob_token_ids: list[int] | None
        logit_bias: dict[str, float] | None

    @model_validator(mode="before")
    @classmethod
    def _kvturn_checks(cls, data: Any) -> Any:
        return _refuse_server_fields(data)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_ids_to_check(self) -> Iterable[tuple[str, Iterable[int]]]:
        """Token ids the client sent, by field (checked against the vocabulary)."""
        yield "stop_token_ids", self.stop_token_ids or ()
        yield "allowed_token_ids", self.allowed_token_ids or ()
        yield "logprob_token_ids", self.logprob_token_ids or ()
        yield "logit_bias", (int(k) for k in (self.logit_bias or {}))


class ChatCompletionRequest(_Checks, _VLLMChatRequest):
    """vLLM's chat request with our checks. `messages` stay dicts (vLLM's typed dicts)."""

    prompt_cache_key: str | None = None
    """OpenAI's cache key: here it names the session (`app.api.sessions.agent_session`)."""

    @property
    def answer_limit(self) -> int | None:
        # `max_tokens` is deprecated in vLLM's model (reading the attribute warns).
        return self.max_completion_tokens or self.__dict__.get("max_tokens")

    @property
    def requested_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def template_messages(self, max_messages: int) -> list[dict[str, Any]]:
        """Messages as the chat template reads them: text content, tool calls with their
        JSON-string arguments, `reasoning_content` for an assistant's reasoning."""
        if not self.messages:
            raise APIError(400, "'messages' must not be empty", param="messages")
        if len(self.messages) > max_messages:
            raise APIError(400, f"at most {max_messages} messages per request", param="messages")
        return [_template_message(i, dict(m)) for i, m in enumerate(self.messages)]


def _template_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    param = f"messages.{index}"
    role = message.get("role")
    if role not in ROLES:
        raise APIError(400, f"{param}.role must be one of {', '.join(ROLES)}", param=f"{param}.role")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        parts = []
        for part in _items(content, f"{param}.content"):
            if (
                not isinstance(part, dict)
                or part.get("type", "text") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400, f"content part type {kind!r} is not supported: text only", param=f"{param}.content"
                )
            parts.append(part["text"])
        content = "".join(parts)
    elif content is None:
        content = ""
    out: dict[str, Any] = {"role": role, "content": content}
    if message.get("name"):
        out["name"] = message["name"]
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise APIError(
                400, f"{param}: only assistant messages carry tool_calls", param=f"{param}.tool_calls"
            )
        out["tool_calls"] = [_template_call(param, c) for c in _items(calls, f"{param}.tool_calls")]
    if role == "tool":
        if not message.get("tool_call_id"):
            raise APIError(
                400, f"{param}: a tool message needs 'tool_call_id'", param=f"{param}.tool_call_id"
            )
        out["tool_call_id"] = str(message["tool_call_id"])
    return out


def _items(value: Any, param: str) -> list:
    """A list from a field vLLM's typed dicts validate lazily (OpenAI's `Iterable[...]`)."""
    from pydantic import ValidationError

    if isinstance(value, (str, bytes, dict)):
        raise APIError(400, f"{param} must be a list", param=param)
    try:
        return list(value)
    except (ValidationError, TypeError, ValueError) as exc:
        raise APIError(400, f"{param} is malformed: {str(exc).splitlines()[0][:200]}", param=param) from None


def _template_call(param: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"{param}.tool_calls: each call needs function.name", param=f"{param}.tool_calls")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise APIError(
            400, f"{param}.tool_calls: function.arguments must be a JSON string", param=f"{param}.tool_calls"
        )
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


class CompletionRequest(_Checks, _VLLMCompletionRequest):
    """vLLM's completion request with our checks: one prompt (text or token ids), no echo."""

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if p is None:
            raise ValueError("'prompt' is required")
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise ValueError("one prompt per request is supported")
                if not p[0]:
                    raise ValueError("prompt must not be empty")
        elif not p:
            raise ValueError("prompt must not be empty")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    @property
    def answer_limit(self) -> int | None:
        return self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text_or_ids(self) -> tuple[str | None, tuple[int, ...] | None]:
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p, None
        return None, tuple(int(t) for t in p)
