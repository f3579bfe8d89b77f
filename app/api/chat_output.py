"""The OpenAI output of one answer: the assistant message of a whole answer and the
deltas of a stream through the request's vLLM parser (tool calls, reasoning), logprobs in
the chat and legacy completions forms, and compact tool-call arguments. Used by
`app.api.shaping`."""

from __future__ import annotations

import uuid
from typing import Any

from app.api.protocol import ChatCompletionRequest


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


class JsonSpaces:
    """Removes whitespace outside JSON strings from text given in pieces (a streamed
    argument string). Tool parsers re-dump the arguments a model generated with spaces
    after `,` and `:`; under compact grammars (`compact_json`) this gives the client the
    arguments as generated."""

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> str:
        out = []
        for char in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in " \t\n\r":
                continue
            out.append(char)
        return "".join(out)


def _tool_call(call, compact: bool) -> dict[str, Any]:
    arguments = JsonSpaces().feed(call.arguments) if compact else call.arguments
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": arguments}}


def chat_message(
    parser, auto_tools: bool, body: ChatCompletionRequest, text: str, token_ids, compact: bool = False
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
        message["tool_calls"] = [_tool_call(c, compact) for c in calls]
        if not content:
            message["content"] = None
    elif content is None:
        message["content"] = ""
    return message, bool(calls)


class ChatStream:
    """Streamed chat deltas of one answer through the request's parser."""

    def __init__(self, parser, body: ChatCompletionRequest, prompt_ids, compact: bool = False):
        self._parser = parser
        self._body = body
        self._prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self._spaces: dict[int, JsonSpaces] | None = {} if compact else None
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
                    if self._spaces is not None and call["function"].get("arguments"):
                        spaces = self._spaces.setdefault(tc.index, JsonSpaces())
                        call["function"]["arguments"] = spaces.feed(call["function"]["arguments"])
                calls.append(call)
            if calls:
                out["tool_calls"] = calls
        return out or None


def finish_reason(engine_reason: str, called_tools: bool) -> str:
    """`tool_calls` when the answer ended (not cut by length) with tool calls."""
    return "tool_calls" if called_tools and engine_reason == "stop" else engine_reason
