"""The APIs a benchmark session can speak (`--api`, one per run): how each turn's request
is made from the conversation, and how its stream is read.

| api       | route                  | each turn sends                        | the session by         |
|-----------|------------------------|----------------------------------------|------------------------|
| chat      | `/v1/chat/completions` | the whole history                      | the session header     |
| responses | `/v1/responses`        | the new input, after the first turn    | `previous_response_id` |
| messages  | `/v1/messages`         | the whole history, as Anthropic blocks | its prompt (no header) |

`bench.client.run_session` keeps the conversation as chat messages (the workload's
message dicts, system first, and the answers) and asks its session's `Dialog` for each
turn's request; every API converts the same conversation, so the prompt the server
renders stays as close to chat's as the API allows.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from typing import Any

from bench.record import TurnRecord
from bench.sse import CompletionStream


class Api(str, Enum):
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"


class TurnFailed(RuntimeError):
    pass


class Reader:
    """Reads one turn's stream, one server-sent `data:` payload at a time, into `record`
    (usage and reuse facts) and the answer's decode steps (`texts`, `stamps`)."""

    end = ""
    """The event that ends a complete answer (named in the error when it never comes)."""

    def __init__(self, record: TurnRecord):
        self.record = record
        self.texts: list[str] = []
        self.stamps: list[float] = []
        """perf_counter() at each decode step's arrival."""

    def feed(self, data: str) -> bool:
        """Take one payload; True once the answer is complete."""
        raise NotImplementedError

    def _step(self, text: str) -> None:
        self.stamps.append(time.perf_counter())
        self.texts.append(text)

    def _kvturn(self, kv: dict[str, Any]) -> None:
        self.record.reused_from_decode = kv.get("reused_from_decode")
        self.record.miss_reason = kv.get("miss_reason")
        self.record.decode_replica = kv.get("decode_replica")
        self.record.spliced = kv.get("spliced")
        self.record.timings = kv.get("timings")
        self.record.placement = kv.get("placement")


class Dialog:
    """One session's side of an API. `bench.client.send_turn` calls `request` once per
    turn with the whole conversation so far, reads the stream with a `reader`, and calls
    `answered` with it after a complete answer (not after a failed one)."""

    path = ""

    def __init__(self, model: str, max_tokens: int):
        self.model = model
        self.max_tokens = max_tokens

    def request(self, messages: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
        """The body and headers of the turn that answers `messages`."""
        raise NotImplementedError

    def reader(self, record: TurnRecord) -> Reader:
        raise NotImplementedError

    def answered(self, reader: Reader) -> None:
        pass


def dialog(api: Api, model: str, max_tokens: int, *, session_id: str, session_header: str) -> Dialog:
    """A new session's dialog for `api` (only chat sends the session header)."""
    api = Api(api)
    if api is Api.CHAT:
        return ChatDialog(model, max_tokens, session_id, session_header)
    if api is Api.RESPONSES:
        return ResponsesDialog(model, max_tokens)
    return MessagesDialog(model, max_tokens)


# -- chat --------------------------------------------------------------------------------


class ChatDialog(Dialog):
    path = "/v1/chat/completions"

    def __init__(self, model: str, max_tokens: int, session_id: str, session_header: str):
        super().__init__(model, max_tokens)
        self.headers = {session_header: session_id}

    def request(self, messages: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        return body, self.headers

    def reader(self, record: TurnRecord) -> Reader:
        return ChatReader(record)


class ChatReader(Reader):
    """Chat chunks, read by the shared `bench.sse.CompletionStream`."""

    end = "[DONE]"

    def __init__(self, record: TurnRecord):
        super().__init__(record)
        self.stream = CompletionStream()
        self.texts = self.stream.texts
        self.stamps = self.stream.stamps

    def feed(self, data: str) -> bool:
        stream = self.stream
        if stream.feed(data):
            return True
        if stream.error is not None:
            raise TurnFailed(f"in-stream error: {stream.error}")
        record = self.record
        if stream.finish_reason:
            record.finish_reason = stream.finish_reason
        if stream.usage:
            usage = stream.usage
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if stream.kvturn is not None:
            self._kvturn(stream.kvturn)
        return False


# -- OpenAI Responses --------------------------------------------------------------------


class ResponsesDialog(Dialog):
    """Stateful: the first turn sends the conversation, each later one only what was
    added since the previous answer, chained by `previous_response_id`. An assistant's
    text is never sent: the server keeps each response's output. An assistant's tool call
    (`tool_calls` workloads) goes as a `function_call` item with its result as the
    `function_call_output`; a tool result for a call the server never saw goes as a user
    message (the server refuses outputs of unknown calls)."""

    path = "/v1/responses"

    def __init__(self, model: str, max_tokens: int):
        super().__init__(model, max_tokens)
        self.previous_id: str | None = None
        self._sent = 1  # messages the chain holds (the system prompt goes as instructions)
        self._asked = 1
        self._calls: set[str] = set()

    def request(self, messages: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
        body: dict[str, Any] = {
            "model": self.model,
            "instructions": messages[0]["content"],
            "input": self._items(messages[self._sent :]),
        }
        if self.previous_id is not None:
            body["previous_response_id"] = self.previous_id
        body.update(max_output_tokens=self.max_tokens, temperature=0, ignore_eos=True, stream=True)
        self._asked = len(messages)
        return body, {}

    def _items(self, messages: list[dict]) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        for m in messages:
            if m["role"] == "assistant":
                for call in m.get("tool_calls") or []:
                    self._calls.add(call["id"])
                    function = call["function"]
                    items.append(
                        {
                            "type": "function_call",
                            "call_id": call["id"],
                            "name": function["name"],
                            "arguments": function["arguments"],
                        }
                    )
            elif m["role"] == "tool" and m["tool_call_id"] in self._calls:
                items.append(
                    {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
                )
            else:
                items.append({"type": "message", "role": "user", "content": m["content"]})
        return items

    def reader(self, record: TurnRecord) -> Reader:
        return ResponsesReader(record)

    def answered(self, reader: Reader) -> None:
        assert isinstance(reader, ResponsesReader)
        self.previous_id = reader.response_id
        self._sent = self._asked


class ResponsesReader(Reader):
    end = "response.completed"

    def __init__(self, record: TurnRecord):
        super().__init__(record)
        self.response_id: str | None = None

    def feed(self, data: str) -> bool:
        event = json.loads(data)
        kind = event.get("type")
        if kind == "response.output_text.delta":
            self._step(event.get("delta") or "")
        elif kind == "response.created":
            self.response_id = (event.get("response") or {}).get("id")
        elif kind in ("response.completed", "response.incomplete"):
            self._final(event.get("response") or {})
            return True
        elif kind == "response.failed":
            raise TurnFailed(f"response failed: {(event.get('response') or {}).get('error')}")
        elif kind == "error":
            raise TurnFailed(f"in-stream error: {event}")
        return False

    def _final(self, response: dict[str, Any]) -> None:
        record = self.record
        self.response_id = response.get("id") or self.response_id
        if self.response_id is None:
            raise TurnFailed("the response has no id to continue the chain from")
        usage = response.get("usage") or {}
        record.prompt_tokens = usage.get("input_tokens")
        record.completion_tokens = usage.get("output_tokens")
        record.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        # The API's own words: "completed", or why it is incomplete ("max_output_tokens").
        record.finish_reason = (response.get("incomplete_details") or {}).get("reason") or response.get(
            "status"
        )
        if response.get("kvturn"):
            self._kvturn(response["kvturn"])


# -- Anthropic Messages ------------------------------------------------------------------


class MessagesDialog(Dialog):
    """The whole conversation every turn, as Claude Code sends it: a tool result is a user
    message of a `tool_result` block, an assistant's tool call a `tool_use` block. No
    session header: the server finds the conversation by its prompt."""

    path = "/v1/messages"

    def request(self, messages: list[dict]) -> tuple[dict[str, Any], dict[str, str]]:
        body = {
            "model": self.model,
            "system": messages[0]["content"],
            "messages": [anthropic_message(m) for m in messages[1:]],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        return body, {}

    def reader(self, record: TurnRecord) -> Reader:
        return MessagesReader(record)


def anthropic_message(m: dict) -> dict[str, Any]:
    """A chat message (user, assistant, tool) as an Anthropic one (user or assistant)."""
    if m["role"] == "tool":
        block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
        return {"role": "user", "content": [block]}
    if m["role"] == "assistant" and m.get("tool_calls"):
        blocks: list[dict[str, Any]] = [{"type": "text", "text": m["content"]}] if m.get("content") else []
        blocks += [
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
            for call in m["tool_calls"]
        ]
        return {"role": "assistant", "content": blocks}
    return {"role": m["role"], "content": m["content"]}


class MessagesReader(Reader):
    end = "message_stop"

    def feed(self, data: str) -> bool:
        event = json.loads(data)
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                self._step(delta.get("text") or "")
        elif kind == "message_delta":
            record = self.record
            usage = event.get("usage") or {}
            cached = usage.get("cache_read_input_tokens") or 0
            if usage.get("input_tokens") is not None:
                record.prompt_tokens = usage["input_tokens"] + cached
                record.cached_tokens = cached
            record.completion_tokens = usage.get("output_tokens")
            record.finish_reason = (event.get("delta") or {}).get("stop_reason")
        elif kind == "message_stop":
            return True
        elif kind == "error":
            raise TurnFailed(f"in-stream error: {event.get('error')}")
        return False
