"""The load generator: runs a workload's sessions against one of the server's APIs
(`bench.apis`: chat completions by default, OpenAI Responses, Anthropic Messages).

Sessions run concurrently (at most `concurrency` at once), the turns of a session one
after another. Every turn is a streaming request; the client times it and reads usage and
the `kvturn` reuse facts from the end of the stream (`bench.sse`), into a
`bench.record.TurnRecord`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from bench.apis import Api, Dialog, TurnFailed, dialog
from bench.record import TurnRecord
from bench.sse import apayloads
from bench.workload import SessionPlan, Workload


async def send_turn(
    client: httpx.AsyncClient,
    url: str,
    dialog: Dialog,
    messages: list[dict],
    *,
    record: TurnRecord,
    t0: float,
) -> str:
    """Send one streaming turn that answers `messages`, fill `record`, return the answer
    text. TTFT is timed to the first decode step the API streams, ITL between steps."""
    body, headers = dialog.request(messages)
    reader = dialog.reader(record)
    start = time.perf_counter()
    record.start_s = start - t0
    async with client.stream("POST", url + dialog.path, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise TurnFailed(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        done = False
        async for data in apayloads(r.aiter_lines()):
            if reader.feed(data):
                done = True
                break
        if not done:
            raise TurnFailed(f"stream ended without {reader.end}")
    end = time.perf_counter()
    stamps = reader.stamps
    if not stamps:
        raise TurnFailed("no content chunk in the stream")
    record.ttft_s = stamps[0] - start
    # To the first step with text: the one definition all three APIs share (chat streams
    # steps whose text is empty, Responses and Messages do not).
    record.ttft_text_s = next((s - start for s, t in zip(stamps, reader.texts, strict=True) if t), None)
    record.e2e_s = end - start
    record.itl_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    text = "".join(reader.texts)
    record.answer_chars = len(text)
    record.ok = True
    dialog.answered(reader)
    return text


Gate = Callable[[int, int], Awaitable[bool]]
"""`gate(session index, turn)`: awaited before each turn; False ends the session."""


async def run_session(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    workload: Workload,
    plan: SessionPlan,
    *,
    session_id: str,
    t0: float,
    on_turn: Callable[[TurnRecord], None],
    session_header: str,
    api: Api = Api.CHAT,
    gate: Gate | None = None,
) -> list[TurnRecord]:
    """The session's turns one after another, in `api`; the conversation is kept as chat
    messages (`bench.apis` converts it). `gate(session, turn)`, if given, is awaited
    before each turn (1-based): a benchmark holds sessions at a turn while it changes the
    app; False ends the session there (its client went away)."""
    session = dialog(
        api, model, workload.spec.answer_tokens, session_id=session_id, session_header=session_header
    )
    messages: list[dict] = [{"role": "system", "content": plan.system or workload.system}]
    records: list[TurnRecord] = []
    for i, turn in enumerate(plan.turns):
        if turn.pause_s:
            await asyncio.sleep(turn.pause_s)
        if gate is not None and not await gate(plan.index, i + 1):
            return records
        session.max_tokens = turn.answer_tokens or workload.spec.answer_tokens
        messages.extend(turn.messages)
        record = TurnRecord(session=plan.index, turn=i + 1, kind=turn.kind)
        try:
            answer = await send_turn(client, url, session, messages, record=record, t0=t0)
        except (TurnFailed, httpx.HTTPError, json.JSONDecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            records.append(record)
            on_turn(record)
            # Later turns would build on a missing answer: count them as not run.
            for j in range(i + 1, len(plan.turns)):
                skipped = TurnRecord(
                    session=plan.index,
                    turn=j + 1,
                    kind=plan.turns[j].kind,
                    error="skipped: an earlier turn failed",
                )
                records.append(skipped)
                on_turn(skipped)
            return records
        records.append(record)
        on_turn(record)
        messages.append(
            _assistant(
                answer, plan.turns[i + 1] if i + 1 < len(plan.turns) else None, workload.spec.tool_calls
            )
        )
    return records


def _assistant(answer: str, next_turn, tool_calls: bool) -> dict:
    """The assistant message a client sends back: the answer's text, or (a `tool_calls`
    workload, before a tool result) a call of that tool with the text as its argument."""
    if not (tool_calls and next_turn is not None and next_turn.kind == "tool"):
        return {"role": "assistant", "content": answer}
    call_id = next_turn.messages[0]["tool_call_id"]
    arguments = json.dumps({"request": answer})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": next_turn.tool_name, "arguments": arguments},
            }
        ],
    }


async def run_workload(
    url: str,
    model: str,
    workload: Workload,
    *,
    session_prefix: str,
    on_turn: Callable[[TurnRecord], None] = lambda r: None,
    session_header: str = "x-session-id",
    timeout_s: float = 1800.0,
    api: Api = Api.CHAT,
    gate: Gate | None = None,
) -> tuple[list[TurnRecord], float]:
    """Run all sessions, each speaking `api`; return their records (session, turn order)
    and the wall time."""
    sem = asyncio.Semaphore(workload.spec.concurrency)
    limits = httpx.Limits(max_connections=workload.spec.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def one(plan: SessionPlan) -> list[TurnRecord]:
            if plan.start_s:  # a trace's arrival time
                await asyncio.sleep(max(0.0, t0 + plan.start_s - time.perf_counter()))
            async with sem:
                return await run_session(
                    client,
                    url,
                    model,
                    workload,
                    plan,
                    session_id=f"{session_prefix}-s{plan.index}",
                    t0=t0,
                    on_turn=on_turn,
                    session_header=session_header,
                    api=api,
                    gate=gate,
                )

        results = await asyncio.gather(*(one(p) for p in workload.sessions))
        wall = time.perf_counter() - t0
    return [r for session in results for r in session], wall


async def served_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        r = await client.get(url + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def kv_stats(url: str) -> dict | None:
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            r = await client.get(url + "/v1/kv/stats")
            return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10.0) as client:
        while True:
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(1.0)
