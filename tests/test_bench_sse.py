"""`bench.sse`: the shared client of the app's event streams (no server)."""

from __future__ import annotations

import asyncio
import json

from bench.sse import CompletionStream, apayloads, payloads


def _chat_stream() -> list[str]:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [1], "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [2], "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [3], "finish_reason": "length"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3},
            "kvturn": {"miss_reason": None, "decode_replica": "r1"},
            "prompt_token_ids": [7, 8],
        },
    ]
    return [f"data: {json.dumps(c)}" for c in chunks] + ["", ": keep-alive", "data: [DONE]"]


def test_payloads_skip_other_lines():
    lines = _chat_stream()
    data = list(payloads(lines))
    assert data[-1] == "[DONE]" and len(data) == 6

    async def collect() -> list[str]:
        async def aiter():
            for line in lines:
                yield line

        return [d async for d in apayloads(aiter())]

    assert asyncio.run(collect()) == data


def test_chat_stream_folds_steps_usage_and_kvturn():
    stream = CompletionStream()
    done = [stream.feed(d) for d in payloads(_chat_stream())]
    assert done == [False] * 5 + [True] and stream.done
    assert stream.texts == ["Hel", "", "lo"] and len(stream.stamps) == 3  # the role chunk is no step
    assert stream.text == "Hello" and stream.token_ids == [1, 2, 3]
    assert stream.finish_reason == "length"
    assert stream.usage == {"prompt_tokens": 10, "completion_tokens": 3}
    assert stream.kvturn == {"miss_reason": None, "decode_replica": "r1"}
    assert stream.prompt_token_ids == [7, 8] and stream.error is None


def test_text_completion_and_error_events():
    stream = CompletionStream()
    stream.feed(json.dumps({"choices": [{"text": "a", "token_ids": [5], "finish_reason": None}]}))
    stream.feed(json.dumps({"error": {"code": "engine_dead"}, "kvturn": {"decode_replica": "r2"}}))
    assert stream.text == "a" and stream.texts == ["a"] and stream.token_ids == [5]
    assert stream.error == {"code": "engine_dead"} and stream.error_replica == "r2"
    assert not stream.done
