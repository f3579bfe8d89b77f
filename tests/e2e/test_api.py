"""The foundation, end to end: P/D serving over HTTP (plain and streaming), handle calls,
the official OpenAI client, token equality with a single engine, KV really moved from
prefill to decode, and OpenAI-style 4xx errors that leave the app serving."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from tests.e2e.helpers import MODEL, SYSTEM, chat, complete, delta, engine_stats, reference_tokens


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def test_models_and_health(apps):
    url = apps["url"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "sse"])
def test_chat_pd_equals_single_engine_and_decode_loaded_prefill_kv(apps, stream):
    url = apps["url"]
    before = engine_stats("PrefillServer")
    reply = chat(
        url, user(f"Summarise the logs of run {int(stream)} for me, please."), stream=stream, max_tokens=20
    )
    assert reply.finish_reason in ("length", "stop")
    assert len(reply.token_ids) == reply.usage["completion_tokens"] > 0
    assert reply.usage["prompt_tokens"] == len(reply.prompt_token_ids)
    # Same greedy tokens as one engine computing the same prompt ids.
    assert reply.token_ids == reference_tokens(url, reply.prompt_token_ids, len(reply.token_ids))
    # Prefill computed the prompt; decode read it over NIXL instead of computing it.
    p = delta(engine_stats("PrefillServer"), before)
    assert p["prompt_tokens_computed"] == reply.usage["prompt_tokens"]
    d = engine_stats("DecodeServer", reply.kvturn["decode_replica"])
    assert d["prompt_tokens_external"] >= reply.usage["prompt_tokens"] - apps["pd"].block_size
    assert d["prompt_tokens_computed"] <= d["requests"] * apps["pd"].block_size + 8
    # Its steps while busy: at least one per token of this answer after the first.
    assert d["engine_busy_steps"] >= len(reply.token_ids) - 1
    assert 0 < d["engine_busy_step_s"] / d["engine_busy_steps"] < 1.0


def test_openai_client_reads_plain_and_streaming(apps):
    import openai

    client = openai.OpenAI(base_url=apps["url"] + "/v1", api_key="unused")
    messages = user("Check the build status of the repository.")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content and plain.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12


def test_deployment_handle_chat_and_stream(apps):
    handle = serve.get_app_handle("pd")
    body = {"model": MODEL, "messages": user("What is in the syslog?"), "max_tokens": 10, "temperature": 0}
    plain = handle.chat.remote(body).result()
    assert plain["object"] == "chat.completion" and plain["usage"]["completion_tokens"] == 10
    chunks = list(handle.options(stream=True).chat_stream.remote(body))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]


def test_completions_with_token_ids(apps):
    url = apps["url"]
    prompt = list(range(10, 130))
    reply = complete(url, prompt, max_tokens=16)
    assert reply.prompt_token_ids == prompt
    assert reply.token_ids == reference_tokens(url, prompt, 16)


BAD_REQUESTS = [
    ("malformed_json", b"{not json", 400),
    ("unknown_model", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
    (
        "max_tokens_zero",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
    ),
    (
        "prompt_too_long",
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 8},
        400,
    ),
    (
        "client_transfer_params",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": [[1]]},
        },
        400,
    ),
    ("no_messages", {"model": MODEL, "messages": []}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error_and_app_keeps_serving(apps, name, body, status):
    url = apps["url"] + "/v1/chat/completions"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if name == "client_transfer_params":
        assert "kv_transfer_params" in error["message"]
    if name == "prompt_too_long":
        assert error["code"] == "context_length_exceeded"
    ok = chat(apps["url"], user("still there?"), max_tokens=4)
    assert len(ok.token_ids) == 4


def test_handle_call_bad_input_raises(apps):
    handle = serve.get_app_handle("pd")
    with pytest.raises(Exception, match="kv_transfer_params"):
        handle.chat.remote(
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {}}
        ).result()
