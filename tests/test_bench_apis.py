"""The benchmark client's three APIs (`python -m bench --api chat|responses|messages`)
against a fake server that streams each API's events: what every turn sends (the whole
history, or only the new input chained by `previous_response_id`), what the client reads
back (TTFT at the first decode step, ITL between steps, prompt and cached tokens), and
that the server's own conversion of a Messages or Responses turn gives back the chat
conversation chat mode sends. No engines, no Ray."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.apis import Api
from bench.client import run_session, run_workload
from bench.workload import SessionPlan, TurnPlan, Workload, WorkloadSpec

URL = "http://bench.test"
SYSTEM = "You are an agent. Be brief."
STEPS = ("<{n}>", " x", " y", " z")  # one decode step each; n: the request's number
FIRST_S = 0.03  # the fake server's time to first token
GAP_S = 0.01  # between decode steps
TOOL_TEXT = '[read_file] {"status": "ok"}'


def workload(tool_calls: bool) -> Workload:
    """One session: a user turn, a tool result (call `call_0_1` of read_file), a user turn."""
    spec = WorkloadSpec(sessions=1, turns=3, concurrency=1, answer_tokens=len(STEPS), tool_calls=tool_calls)
    turns = (
        TurnPlan("user", ({"role": "user", "content": "Task 0.0: weather"},), 3),
        TurnPlan(
            "tool",
            ({"role": "tool", "tool_call_id": "call_0_1", "content": TOOL_TEXT},),
            6,
            tool_name="read_file",
        ),
        TurnPlan("user", ({"role": "user", "content": "Task 0.2: logs"},), 3),
    )
    return Workload(spec, SYSTEM, (SessionPlan(0, turns),), exact_tokens=False)


def answer(n: int) -> str:
    return "".join(STEPS).format(n=n)


def usage(n: int) -> tuple[int, int]:
    """Prompt and cached tokens of the fake server's n-th request."""
    return 1000 * n, 1000 * (n - 1)


def kvturn(n: int) -> dict:
    return {
        "session_id": "sess-1",
        "decode_replica": "d0",
        "reused_from_decode": 900 * (n - 1),
        "miss_reason": "new_session" if n == 1 else None,
        "spliced": False,
        "placement": "short" if n > 1 else "later",
        "timings": {"first_token_s": 0.02, "prefill_s": 0.01},
    }


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def chat_events(n: int) -> list[str]:
    prompt, cached = usage(n)
    steps = [
        {"choices": [{"index": 0, "delta": {"content": s.format(n=n)}, "token_ids": [7]}]} for s in STEPS
    ]
    steps[-1]["choices"][0]["finish_reason"] = "length"
    return [
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        *(sse(s) for s in steps),
        sse(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": len(STEPS),
                    "total_tokens": prompt + len(STEPS),
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
                "kvturn": kvturn(n),
            }
        ),
        sse("[DONE]"),
    ]


def responses_events(n: int) -> list[str]:
    prompt, cached = usage(n)
    opening = {"id": f"resp_{n}", "status": "in_progress", "output": []}
    final = {
        "id": f"resp_{n}",
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
        "output": [{"type": "message", "content": [{"type": "output_text", "text": answer(n)}]}],
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": len(STEPS),
            "total_tokens": prompt + len(STEPS),
        },
        "kvturn": kvturn(n),
    }
    events = [
        {"type": "response.created", "response": opening},
        {"type": "response.in_progress", "response": opening},
        {"type": "response.output_item.added", "item": {"type": "message"}},
        {"type": "response.content_part.added", "part": {"type": "output_text", "text": ""}},
        *({"type": "response.output_text.delta", "delta": s.format(n=n)} for s in STEPS),
        {"type": "response.output_text.done", "text": answer(n)},
        {"type": "response.content_part.done"},
        {"type": "response.output_item.done"},
        {"type": "response.incomplete", "response": final},
    ]
    return [sse(e, e["type"]) for e in events]


def messages_events(n: int) -> list[str]:
    prompt, cached = usage(n)
    end_usage = {"input_tokens": prompt - cached, "output_tokens": len(STEPS)}
    if cached:  # vLLM leaves the field out when nothing was cached
        end_usage["cache_read_input_tokens"] = cached
    events = [
        {"type": "message_start", "message": {"id": f"msg_{n}", "usage": {"input_tokens": prompt}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *(
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": s.format(n=n)},
            }
            for s in STEPS
        ),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": end_usage},
        {"type": "message_stop"},
    ]
    return [sse(e, e["type"]) for e in events]


STREAMS = {
    "/v1/chat/completions": chat_events,
    "/v1/responses": responses_events,
    "/v1/messages": messages_events,
}


class FakeServer:
    """Answers each API's route with that API's stream: a pause before the first decode
    step and between steps, so the client's timing can be checked. `fail` maps a request
    number to the events that replace its stream (or an HTTP status)."""

    def __init__(self, fail: dict[int, list[str] | int] | None = None):
        self.requests: list[tuple[str, dict, httpx.Headers]] = []
        self.fail = fail or {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body, request.headers))
        n = len(self.requests)
        failure = self.fail.get(n)
        if isinstance(failure, int):
            return httpx.Response(failure, json={"error": {"message": "bad request"}})
        events = failure if failure is not None else STREAMS[request.url.path](n)

        async def stream():
            steps = 0
            for event in events:
                if any(marker in event for marker in ('"token_ids"', "output_text.delta", "text_delta")):
                    await asyncio.sleep(FIRST_S if steps == 0 else GAP_S)
                    steps += 1
                yield event.encode()

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream())


async def session(api: Api, *, tool_calls: bool = False, server: FakeServer | None = None):
    server = server or FakeServer()
    seen = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
        records = await run_session(
            client,
            URL,
            "m",
            workload(tool_calls),
            workload(tool_calls).sessions[0],
            session_id="bench-x-s0",
            t0=0.0,
            on_turn=seen.append,
            session_header="x-session-id",
            api=api,
        )
    assert seen == records
    return records, server.requests


@pytest.mark.parametrize("api", list(Api))
async def test_every_api_records_timing_and_tokens(api):
    records, requests = await session(api)
    assert [path for path, _, _ in requests] == [
        {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}[api.value]
    ] * 3
    for n, record in enumerate(records, start=1):
        assert record.ok and record.error is None, record
        assert (record.turn, record.kind) == (n, ("user", "tool", "user")[n - 1])
        assert record.ttft_s >= FIRST_S  # timed to the first decode step, not the opening events
        assert len(record.itl_s) == len(STEPS) - 1 and min(record.itl_s) >= GAP_S * 0.9
        assert record.e2e_s >= record.ttft_s + sum(record.itl_s)
        assert (record.prompt_tokens, record.cached_tokens) == usage(n)
        assert record.completion_tokens == len(STEPS)
        assert record.answer_chars == len(answer(n))
        assert record.finish_reason == {"chat": "length", "responses": "max_output_tokens"}.get(
            api.value, "max_tokens"
        )
        if api is Api.MESSAGES:  # no kvturn extension in Anthropic's API
            assert (record.reused_from_decode, record.miss_reason, record.timings) == (None, None, None)
        else:
            assert record.reused_from_decode == 900 * (n - 1)
            assert record.timings == kvturn(n)["timings"]
            assert record.placement == kvturn(n)["placement"]


async def test_chat_sends_the_whole_history_with_the_session_header():
    _, requests = await session(Api.CHAT, tool_calls=True)
    path, body, headers = requests[2]
    assert headers["x-session-id"] == "bench-x-s0"
    arguments = json.dumps({"request": answer(1)})
    assert body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Task 0.0: weather"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0_1", "content": TOOL_TEXT},
            {"role": "assistant", "content": answer(2)},
            {"role": "user", "content": "Task 0.2: logs"},
        ],
        "max_tokens": len(STEPS),
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


@pytest.mark.parametrize("tool_calls", [True, False])
async def test_responses_sends_only_the_new_input_chained_to_the_previous_response(tool_calls):
    records, requests = await session(Api.RESPONSES, tool_calls=tool_calls)
    assert all(r.ok for r in records)
    bodies = [body for _, body, _ in requests]
    assert all("x-session-id" not in headers for _, _, headers in requests)
    common = {"model": "m", "instructions": SYSTEM, "max_output_tokens": len(STEPS), "temperature": 0}
    for body in bodies:
        assert body.items() >= {**common, "ignore_eos": True, "stream": True}.items()
    assert "previous_response_id" not in bodies[0]
    assert [b.get("previous_response_id") for b in bodies[1:]] == ["resp_1", "resp_2"]
    assert bodies[0]["input"] == [{"type": "message", "role": "user", "content": "Task 0.0: weather"}]
    if tool_calls:
        call = {
            "type": "function_call",
            "call_id": "call_0_1",
            "name": "read_file",
            "arguments": json.dumps({"request": answer(1)}),
        }
        output = {"type": "function_call_output", "call_id": "call_0_1", "output": TOOL_TEXT}
        assert bodies[1]["input"] == [call, output]
    else:  # chat sends a tool message without a call; a chain can't: a user message
        assert bodies[1]["input"] == [{"type": "message", "role": "user", "content": TOOL_TEXT}]
    # The previous answer's text stays on the server.
    assert bodies[2]["input"] == [{"type": "message", "role": "user", "content": "Task 0.2: logs"}]


@pytest.mark.parametrize("tool_calls", [True, False])
async def test_messages_sends_the_whole_history_as_anthropic_blocks(tool_calls):
    _, requests = await session(Api.MESSAGES, tool_calls=tool_calls)
    assert all("x-session-id" not in headers for _, _, headers in requests)
    body = requests[2][1]
    assert body["system"] == SYSTEM and body["max_tokens"] == len(STEPS)
    assert (body["temperature"], body["ignore_eos"], body["stream"]) == (0, True, True)
    if tool_calls:
        use = {"type": "tool_use", "id": "call_0_1", "name": "read_file", "input": {"request": answer(1)}}
        first_answer = {"role": "assistant", "content": [use]}
    else:
        first_answer = {"role": "assistant", "content": answer(1)}
    assert body["messages"] == [
        {"role": "user", "content": "Task 0.0: weather"},
        first_answer,
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_0_1", "content": TOOL_TEXT}],
        },
        {"role": "assistant", "content": answer(2)},
        {"role": "user", "content": "Task 0.2: logs"},
    ]


@pytest.mark.parametrize(
    "api, events, needle",
    [
        (
            Api.RESPONSES,
            [sse({"type": "response.failed", "response": {"error": {"message": "boom"}}}, "response.failed")],
            "boom",
        ),
        (Api.MESSAGES, [sse({"type": "error", "error": {"message": "boom"}}, "error")], "boom"),
        (Api.RESPONSES, responses_events(2)[:-1], "without response.completed"),
        (Api.MESSAGES, messages_events(2)[:-1], "without message_stop"),
        (Api.MESSAGES, 400, "HTTP 400"),
    ],
)
async def test_a_failed_turn_ends_the_session(api, events, needle):
    records, requests = await session(api, server=FakeServer(fail={2: events}))
    assert len(requests) == 2
    assert records[0].ok and not records[1].ok and needle in records[1].error
    assert records[2].error == "skipped: an earlier turn failed"


async def test_run_workload_threads_the_api_to_every_session(monkeypatch):
    server = FakeServer()
    spec = WorkloadSpec(sessions=3, turns=3, concurrency=2, answer_tokens=len(STEPS))
    plans = tuple(SessionPlan(i, workload(False).sessions[0].turns) for i in range(3))
    transport = httpx.MockTransport(server)

    class Client(httpx.AsyncClient):  # run_workload makes its own client: give it the fake
        def __init__(self, **kwargs):
            super().__init__(transport=transport, **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", Client)
    records, wall = await run_workload(
        URL, "m", Workload(spec, SYSTEM, plans, False), session_prefix="p", api=Api.MESSAGES
    )
    assert wall > 0 and len(records) == 9 and all(r.ok for r in records)
    assert {path for path, _, _ in server.requests} == {"/v1/messages"}


# -- what the server makes of it (its own converters; needs vLLM) -------------------------


def chat_conversation(tool_calls: bool) -> list[dict]:
    """What chat mode sends at turn 3 (request bodies are checked above)."""
    calls = [
        {
            "id": "call_0_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"request": answer(1)})},
        }
    ]
    first = {"role": "assistant", "content": None, "tool_calls": calls} if tool_calls else None
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Task 0.0: weather"},
        first or {"role": "assistant", "content": answer(1)},
        {"role": "tool", "tool_call_id": "call_0_1", "content": TOOL_TEXT},
        {"role": "assistant", "content": answer(2)},
        {"role": "user", "content": "Task 0.2: logs"},
    ]


def plain(messages: list[dict]) -> list[dict]:
    """Messages compared by what a chat template reads: a None content is no content, and
    a Responses item's `type` is not read."""
    return [{k: v for k, v in dict(m).items() if v is not None and k != "type"} for m in messages]


@pytest.mark.parametrize("tool_calls", [True, False])
async def test_the_server_reads_a_messages_turn_as_chat_mode_sends_it(tool_calls):
    pytest.importorskip("vllm")
    from app.api import messages_api

    _, requests = await session(Api.MESSAGES, tool_calls=tool_calls)
    data = requests[2][1]
    body = messages_api.chat_request(messages_api.parse(data), merge_inline_system=False)
    body = messages_api.chat_extensions(data, body)
    assert plain(body.messages) == plain(chat_conversation(tool_calls))
    assert body.ignore_eos and body.max_completion_tokens == len(STEPS)


async def test_the_server_reads_a_responses_chain_as_chat_mode_sends_it_plus_the_answer():
    """With tool calls the stored answer stays before the call (chat mode replaces it)."""
    pytest.importorskip("vllm")
    from app.api import responses_api

    _, requests = await session(Api.RESPONSES, tool_calls=True)
    history: list[dict] = []
    for n, (_, body, _) in enumerate(requests, start=1):
        request = responses_api.parse(body)
        messages = responses_api.chat_messages(request, history or None)
        history = [*messages, {"role": "assistant", "content": answer(n)}]  # as the server stores it
    expected = chat_conversation(True)
    expected[2:2] = [{"role": "assistant", "content": answer(1)}]
    assert plain(messages) == plain(expected)


# -- the report -------------------------------------------------------------------------


@pytest.mark.parametrize("api", [Api.CHAT, Api.MESSAGES])
async def test_the_report_names_the_api(api):
    from bench import report
    from bench.runner import ModeRun

    records, _ = await session(api)
    run = ModeRun(mode="bidir", label="bidir", records=records, wall_s=1.0, api=api)
    results = report.build_results({"profile": "test", "api": api.value}, [run], 3)
    assert results["modes"]["bidir"]["api"] == api.value
    later = results["modes"]["bidir"]["turns"][1]
    assert (later["prompt_tokens"], later["cached_tokens"]) == usage(2)
    text = report.markdown(results)
    assert f"API `{api.value}`" in text
    # From decode: the kvturn extension's count, or "-" where the API has none.
    row = next(line for line in text.splitlines() if line.startswith("| bidir | 2 |"))
    assert row.rstrip(" |").endswith("900" if api is Api.CHAT else "-")
