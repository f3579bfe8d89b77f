"""Clients for the end-to-end tests: HTTP (plain, and SSE through the shared `bench.sse`),
engine stats, reference tokens."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from bench.sse import CompletionStream, payloads

MODEL = "tiny-qwen3"
SYSTEM = "You are a helpful assistant. Use the tools when they help, and answer briefly. " * 2


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    usage: dict
    kvturn: dict
    finish_reason: str


def chat(
    url: str,
    messages: list[dict],
    *,
    session: str | None = None,
    stream: bool = False,
    max_tokens: int = 24,
    path="/v1/chat/completions",
    **extra,
) -> Reply:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    return _send(url + path, body, session, stream, chat=True)


def complete(
    url: str, prompt, *, session: str | None = None, stream: bool = False, max_tokens: int = 24
) -> Reply:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    return _send(url + "/v1/completions", body, session, stream, chat=False)


def _send(url, body, session, stream, *, chat: bool) -> Reply:
    headers = {"x-session-id": session} if session else {}
    if not stream:
        r = httpx.post(url, json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        b = r.json()
        choice = b["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return Reply(
            text, choice["token_ids"], b["prompt_token_ids"], b["usage"], b["kvturn"], choice["finish_reason"]
        )
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = list(payloads(r.iter_lines()))
    assert data[-1] == "[DONE]"
    answer = CompletionStream()  # chat and text completion chunks alike
    for payload in data:
        answer.feed(payload)
        assert answer.error is None, payload
    return Reply(
        answer.text,
        answer.token_ids,
        answer.prompt_token_ids,
        answer.usage,
        answer.kvturn,
        answer.finish_reason,
    )


def reference_tokens(url: str, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens of one plain engine recomputing the same prompt ids."""
    r = httpx.post(
        url + "/ref/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt_ids,
            "max_tokens": n,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def engine_stats(deployment: str, replica: str | None = None, app: str = "pd") -> dict:
    from ray import serve

    from app.engines.wire import ReplicaQuery

    handle = serve.get_deployment_handle(deployment, app)
    stats = handle.stats.remote(ReplicaQuery(replica)).result()
    if replica is not None:
        assert stats["replica_id"] == replica, "the router did not honour the replica query"
    return stats


def kv_stats(url: str) -> dict:
    return httpx.get(url + "/v1/kv/stats", timeout=30).json()


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}
