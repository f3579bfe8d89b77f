"""The OpenAI surface around a turn: request bodies in, response bodies out.

* `read_body`: an HTTP body within the size limit (413 past it, from Content-Length
  before reading), parsed as JSON that the rest of the stack can hold (400 for invalid
  JSON, lone surrogates, nesting past `MAX_DEPTH`, integers Python refuses to parse).
* `OutputParsers`: vLLM's own tool-call and reasoning parsers (`vllm.parser`), picked
  by config with a per-family default, one instance per request.
* `ChatShaper` / `CompletionShaper`: engine output (text, token ids, logprobs) into
  OpenAI `message` / `delta` / `logprobs` objects, tool calls and reasoning included.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from app.config import AppConfig
from app.errors import APIError, client_error
from app.protocol import ChatCompletionRequest

logger = logging.getLogger("ray.serve")

MAX_DEPTH = 64
"""Deepest JSON nesting a request may have (OpenAI bodies need a handful of levels;
tool schemas a few more)."""

TEMPLATE_KWARGS_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# -- requests ------------------------------------------------------------------------------


async def read_body(request, limit: int) -> dict[str, Any]:
    """The JSON object of an HTTP request, or APIError (413 / 400)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            too_big = int(length) > limit
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if too_big:
            raise APIError(413, f"the request body is larger than {limit} bytes", type="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", type="request_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, oversized integers
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_values(data)
    return data


def check_json_values(data: Any) -> None:
    """Refuse what JSON allows but the stack can't hold: lone UTF-16 surrogates (they
    can't be encoded, e.g. by the tokenizer) and nesting deeper than `MAX_DEPTH`."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body contains a lone UTF-16 surrogate (invalid Unicode)") from None


def template_kwargs(cfg: AppConfig, body: ChatCompletionRequest) -> dict[str, Any]:
    """Chat template keyword arguments: the configured defaults under the request's
    `chat_template_kwargs` (as vLLM's --default-chat-template-kwargs), minus the names
    the renderer itself sets."""
    given = body.chat_template_kwargs or {}
    bad = sorted(set(given) & TEMPLATE_KWARGS_RESERVED)
    if bad:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs"
        )
    return {**cfg.openai.chat_template_kwargs, **given}


def check_structured_output(params) -> None:
    """Compile the request's grammar here (vLLM's xgrammar check) so a schema the decode
    engine would refuse answers 400 before anything runs."""
    if params.structured_outputs is None:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(params.clone())
    except VLLMValidationError:
        raise
    except (ValueError, TypeError) as exc:
        raise client_error(exc) from exc


# -- output parsers ------------------------------------------------------------------------


def default_tool_parser(cfg: AppConfig) -> str | None:
    """The tool parser for `tool_call_parser: auto`: hermes-style `<tool_call>` JSON for
    the Qwen and Hermes families (the embedded model included), none otherwise."""
    name = f"{cfg.model} {cfg.model_name}".lower()
    if any(family in name for family in ("qwen", "hermes")):
        return "hermes"
    return None


class OutputParsers:
    """vLLM's tool and reasoning parsers for this app, composed by vLLM's ParserManager."""

    def __init__(self, cfg: AppConfig, tokenizer):
        from vllm.parser import ParserManager

        tool = cfg.openai.tool_call_parser
        self.tool_parser = default_tool_parser(cfg) if tool == "auto" else tool
        self.reasoning_parser = cfg.openai.reasoning_parser
        self._tokenizer = tokenizer
        self._cls = ParserManager.get_parser(
            tool_parser_name=self.tool_parser,
            reasoning_parser_name=self.reasoning_parser,
            enable_auto_tools=self.tool_parser is not None,
            model_name=cfg.model,
            tool_strict_level=cfg.openai.tool_strict_level,
            tokenizer=tokenizer,
        )

    @property
    def auto_tools(self) -> bool:
        return self.tool_parser is not None

    def for_request(self, body: ChatCompletionRequest, kwargs: dict[str, Any]):
        """A parser for one chat request (None: plain content), after letting it adjust
        the request as vLLM's server does (named/required tool choice -> a JSON schema
        for guided decoding; tool markup kept in the text)."""
        needs_tools = bool(body.tools) and body.tool_choice not in (None, "none")
        if needs_tools and self._cls is None:
            if body.tool_choice == "auto":
                return None  # no parser: answers come back as content
            raise APIError(
                400,
                "tool_choice other than 'auto'/'none' needs a tool parser (openai.tool_call_parser)",
                param="tool_choice",
            )
        if self._cls is None:
            return None
        parser = self._cls(self._tokenizer, body.tools, chat_template_kwargs=kwargs)
        if needs_tools or self.reasoning_parser:
            parser.adjust_request(body)
        return parser


# -- responses -----------------------------------------------------------------------------


def _safe_logprob(value: float) -> float:
    return max(value, -9999.0) if value == value else -9999.0  # -inf and nan are not JSON


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(entries) -> dict[str, Any] | None:
    """OpenAI chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    if entries is None:
        return None
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _safe_logprob(e.logprob),
                "bytes": _bytes(e.token),
                "top_logprobs": [
                    {"token": t, "logprob": _safe_logprob(lp), "bytes": _bytes(t)} for _, lp, t in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries, offset: int = 0) -> dict[str, Any] | None:
    """Legacy completions logprobs: parallel `tokens`, `token_logprobs`, `top_logprobs`
    (token -> logprob per position), `text_offset` (from `offset`)."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
        tokens.append(e.token)
    return {
        "tokens": tokens,
        "token_logprobs": [_safe_logprob(e.logprob) for e in entries],
        "top_logprobs": [{t: _safe_logprob(lp) for _, lp, t in e.top} for e in entries],
        "text_offset": offsets,
    }


def call_id() -> str:
    """A tool call id in OpenAI's form (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


def _tool_call(call) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_message(
    parser, auto_tools: bool, body: ChatCompletionRequest, text: str, token_ids
) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole answer, and whether it calls tools."""
    if parser is None:
        return {"role": "assistant", "content": text}, False
    reasoning, content, calls = parser.parse(
        text, body, enable_auto_tools=auto_tools, model_output_token_ids=list(token_ids)
    )
    if calls and body.parallel_tool_calls is False:
        calls = calls[:1]  # as vLLM's server: the first call only
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None and body.include_reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_tool_call(c) for c in calls]
        if not content:
            message["content"] = None
    elif content is None:
        message["content"] = ""
    return message, bool(calls)


class ChatStream:
    """Streamed chat deltas of one answer through the request's parser."""

    def __init__(self, parser, body: ChatCompletionRequest, prompt_ids):
        self._parser = parser
        self._body = body
        self._prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.called_tools = False

    def delta(self, text: str, token_ids, *, finished: bool = False) -> dict[str, Any] | None:
        """The OpenAI `delta` for this piece of output (None: nothing to send yet)."""
        if self._parser is None:
            return {"content": text} if text else None
        dm = self._parser.parse_delta(text, list(token_ids), self._body, self._prompt_ids, finished=finished)
        if dm is None:
            return None
        out: dict[str, Any] = {}
        if dm.reasoning:
            out["reasoning_content"] = dm.reasoning
        if dm.content:
            out["content"] = dm.content
        if dm.tool_calls:
            self.called_tools = True
            calls = []
            for tc in dm.tool_calls:
                if self._body.parallel_tool_calls is False and tc.index > 0:
                    continue  # the first call only
                call = tc.model_dump(exclude_none=True)
                if "id" in call:
                    call["id"] = call_id()
                if "function" in call:
                    call["function"] = {k: v for k, v in call["function"].items() if v is not None}
                calls.append(call)
            if calls:
                out["tool_calls"] = calls
        return out or None


def finish_reason(engine_reason: str, called_tools: bool) -> str:
    """`tool_calls` when the answer ended (not cut by length) with tool calls."""
    return "tool_calls" if called_tools and engine_reason == "stop" else engine_reason
