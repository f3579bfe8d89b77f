"""The one client of this app's server-sent event streams, shared by the benchmark's
readers (`bench.apis`), the soak run (`bench.soak`) and the end-to-end tests
(`tests/e2e/helpers.py`).

* `payloads` / `apayloads`: the `data:` payloads of a stream's lines (an httpx
  response's `iter_lines()` / `aiter_lines()`), every other line skipped.
* `CompletionStream`: folds the payloads of an OpenAI chat or text completion stream
  (JSON chunks, `[DONE]` last) into the answer: its decode steps (text and arrival time
  of each), all its text, token ids, usage, the `kvturn` facts and the prompt's token ids
  that come with them, the finish reason, and an in-stream error event if one came. It
  raises nothing on an error event: each caller decides what an error means to it.

The Responses and Messages APIs' events are read by `bench.apis` from `payloads`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

DATA = "data: "
DONE = "[DONE]"


def payloads(lines: Iterable[str]) -> Iterator[str]:
    """The `data:` payloads among a stream's lines, in order."""
    for line in lines:
        if line.startswith(DATA):
            yield line[len(DATA) :]


async def apayloads(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    """`payloads` of an async stream of lines."""
    async for line in lines:
        if line.startswith(DATA):
            yield line[len(DATA) :]


class CompletionStream:
    """One chat (or text) completion stream, a payload at a time (`feed`)."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        """Each decode step's text (empty for special tokens)."""
        self.stamps: list[float] = []
        """perf_counter() at each decode step's arrival."""
        self.parts: list[str] = []
        """The text of every choice of every chunk (`text` joins them)."""
        self.token_ids: list[int] = []
        self.usage: dict[str, Any] | None = None
        self.kvturn: dict[str, Any] | None = None
        """The last `kvturn` extension seen."""
        self.prompt_token_ids: list[int] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None
        """The last in-stream error event's `error`."""
        self.error_replica: str | None = None
        """The decode replica that error event names (`kvturn.decode_replica`)."""
        self.done = False
        """`[DONE]` arrived: the stream is complete."""

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, data: str) -> bool:
        """Take one payload; True at `[DONE]`."""
        if data == DONE:
            self.done = True
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = chunk["error"]
            self.error_replica = (chunk.get("kvturn") or {}).get("decode_replica")
        now = time.perf_counter()
        for choice in chunk.get("choices") or []:
            if "delta" in choice:
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                # The opening chunk only names the role; every later delta carries the
                # output of a decode step: its token ids (`return_token_ids`), and its
                # text, which is empty for special tokens.
                step = bool(choice.get("token_ids")) or ("content" in delta and "role" not in delta)
            else:  # a text completion
                text = choice.get("text") or ""
                step = bool(choice.get("token_ids")) or "text" in choice
            if step:
                self.stamps.append(now)
                self.texts.append(text)
            self.parts.append(text)
            self.token_ids.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if "kvturn" in chunk:
            self.kvturn = chunk["kvturn"]
            self.prompt_token_ids = chunk.get("prompt_token_ids")
        return False
