"""Bad input over both endpoints: each kind gets its 4xx with an OpenAI-style `error`
body within 5 s (streaming requests included: errors known before the first byte keep
their status), and the app answers a normal request after all of them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.helpers import MODEL, chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}


def c(**fields):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **fields}


def p(**fields):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}


def nested(depth: int) -> bytes:
    return ('{"model": "tiny-qwen3", "messages": ' + "[" * depth + "]" * depth + "}").encode()


# (name, path, body: dict | bytes, status, extra headers)
CASES = [
    ("malformed_json", CHAT, b"{not json", 400, {}),
    ("json_array_body", CHAT, b"[1, 2]", 400, {}),
    ("empty_body", CHAT, b"", 400, {}),
    (
        "lone_surrogate",
        CHAT,
        b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        {},
    ),
    ("lone_surrogate_completion", COMPLETIONS, b'{"model": "tiny-qwen3", "prompt": "a\\udfff"}', 400, {}),
    ("deep_nesting", CHAT, nested(5000), 400, {}),
    ("deep_nesting_below_recursion", CHAT, nested(200), 400, {}),
    (
        "huge_integer",
        CHAT,
        b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "x"}], "max_tokens": '
        + b"9" * 5000
        + b"}",
        400,
        {},
    ),
    (
        "invalid_utf8",
        CHAT,
        b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        {},
    ),
    ("seed_beyond_int64", CHAT, c(seed=2**64), 400, {}),
    ("seed_beyond_int64_completion", COMPLETIONS, p(seed=-(2**64)), 400, {}),
    ("empty_stop", CHAT, c(stop=[""]), 400, {}),
    ("empty_stop_completion", COMPLETIONS, p(stop=""), 400, {}),
    ("unknown_model", CHAT, {**c(), "model": "gpt-4"}, 404, {}),
    ("unknown_model_completion", COMPLETIONS, {**p(), "model": "gpt-4"}, 404, {}),
    ("unknown_model_stream", CHAT, {**c(), "model": "gpt-4", "stream": True}, 404, {}),
    ("max_tokens_zero", CHAT, c(max_tokens=0), 400, {}),
    ("max_tokens_string", COMPLETIONS, p(max_tokens="many"), 400, {}),
    ("prompt_too_long", CHAT, c(messages=[{"role": "user", "content": "word " * 5000}]), 400, {}),
    (
        "prompt_too_long_stream",
        CHAT,
        c(messages=[{"role": "user", "content": "word " * 5000}], stream=True),
        400,
        {},
    ),
    ("prompt_too_long_completion_stream", COMPLETIONS, p(prompt="word " * 5000, stream=True), 400, {}),
    (
        "client_transfer_params",
        CHAT,
        c(kv_transfer_params={"do_remote_decode": True, "remote_block_ids": [[1]]}),
        400,
        {},
    ),
    ("client_transfer_params_completion", COMPLETIONS, p(kv_transfer_params={}), 400, {}),
    ("no_messages", CHAT, c(messages=[]), 400, {}),
    ("messages_not_list", CHAT, c(messages="hi"), 400, {}),
    ("bad_role", CHAT, c(messages=[{"role": "robot", "content": "x"}]), 400, {}),
    ("content_number", CHAT, c(messages=[{"role": "user", "content": 5}]), 400, {}),
    (
        "image_content",
        CHAT,
        c(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
            ]
        ),
        400,
        {},
    ),
    ("tool_message_without_id", CHAT, c(messages=[{"role": "tool", "content": "x"}]), 400, {}),
    ("n_two", CHAT, c(n=2), 400, {}),
    ("n_two_completion", COMPLETIONS, p(n=3), 400, {}),
    ("top_logprobs_too_many", CHAT, c(logprobs=True, top_logprobs=50), 400, {}),
    ("top_logprobs_without_logprobs", CHAT, c(top_logprobs=2), 400, {}),
    ("logprobs_too_many_completion", COMPLETIONS, p(logprobs=99), 400, {}),
    ("presence_penalty_out_of_range", CHAT, c(presence_penalty=9), 400, {}),
    ("frequency_penalty_out_of_range_completion", COMPLETIONS, p(frequency_penalty=-9), 400, {}),
    ("temperature_negative", CHAT, c(temperature=-1), 400, {}),
    ("top_p_zero", COMPLETIONS, p(top_p=0), 400, {}),
    ("logit_bias_not_token", CHAT, c(logit_bias={"hello": 1}), 400, {}),
    ("logit_bias_out_of_range", CHAT, c(logit_bias={"5": 1000}), 400, {}),
    ("logit_bias_token_outside_vocab", COMPLETIONS, p(logit_bias={"99999999": 1}), 400, {}),
    ("stop_token_outside_vocab", CHAT, c(stop_token_ids=[10**9]), 400, {}),
    ("prompt_ids_outside_vocab", COMPLETIONS, p(prompt=[1, 2, 10**9]), 400, {}),
    ("prompt_negative_id", COMPLETIONS, p(prompt=[1, -5]), 400, {}),
    ("two_prompts", COMPLETIONS, p(prompt=["a", "b"]), 400, {}),
    ("echo", COMPLETIONS, p(echo=True), 400, {}),
    ("tools_empty", CHAT, c(tools=[]), 400, {}),
    (
        "tools_bad_schema",
        CHAT,
        c(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
        400,
        {},
    ),
    ("tools_no_name", CHAT, c(tools=[{"type": "function", "function": {"parameters": {}}}]), 400, {}),
    (
        "tool_choice_unknown_tool",
        CHAT,
        c(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        400,
        {},
    ),
    ("tool_choice_without_tools", CHAT, c(tool_choice="required"), 400, {}),
    ("tool_choice_bad_value", CHAT, c(tools=[TOOL], tool_choice="sometimes"), 400, {}),
    ("response_format_no_schema", CHAT, c(response_format={"type": "json_schema"}), 400, {}),
    (
        "response_format_bad_schema",
        CHAT,
        c(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}),
        400,
        {},
    ),
    (
        "response_format_grammar_unsupported",
        CHAT,
        c(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
                    },
                },
            }
        ),
        400,
        {},
    ),
    (
        "response_format_grammar_unsupported_stream",
        CHAT,
        c(
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
            },
        ),
        400,
        {},
    ),
    ("response_format_bad_type", COMPLETIONS, p(response_format={"type": "yaml"}), 400, {}),
    ("stream_options_without_stream", CHAT, c(stream_options={"include_usage": True}), 400, {}),
    ("chat_template_kwargs_reserved", CHAT, c(chat_template_kwargs={"tokenize": True}), 400, {}),
    ("beam_search", COMPLETIONS, p(use_beam_search=True), 400, {}),
    ("session_id_too_long", CHAT, c(), 400, {"x-session-id": "s" * 5000}),
    ("too_many_messages", CHAT, c(messages=MSG * 5000), 400, {}),
    ("body_too_large", CHAT, c(messages=[{"role": "user", "content": "x" * (10 << 20)}]), 413, {}),
]


@pytest.mark.parametrize("name,path,body,status,headers", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_a_fast_openai_4xx(apps, name, path, body, status, headers):
    url = apps["url"] + path
    started = time.monotonic()
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json", **headers}, timeout=30)
    else:
        r = httpx.post(
            url,
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json", **headers},
            timeout=30,
        )
    took = time.monotonic() - started
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert error["message"] and error["type"]
    assert took < 5.0, f"{name} took {took:.1f} s"
    if name.startswith("prompt_too_long"):
        assert error["code"] == "context_length_exceeded"
    if name.startswith("client_transfer_params"):
        assert "kv_transfer_params" in error["message"]
    if name.startswith("n_two"):
        assert "'n'" in error["message"]


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", CHAT, 405),
        ("PUT", COMPLETIONS, 405),
        ("GET", "/v1/nothing-here", 404),
        ("POST", "/v1/models", 405),
    ],
)
def test_routing_errors_are_openai_shaped(apps, method, path, status):
    r = httpx.request(method, apps["url"] + path, timeout=30)
    assert r.status_code == status
    assert r.json()["error"]["message"]


def test_app_still_answers_after_bad_input(apps):
    reply = chat(apps["url"], [{"role": "user", "content": "still there?"}], max_tokens=4)
    assert len(reply.token_ids) == 4


def test_an_answer_limit_past_the_context_is_cut_to_what_it_leaves(apps):
    """As vLLM's server does: `max_tokens` larger than the context leaves is not an error;
    the answer takes the room there is and ends with finish_reason "length"."""
    limit = apps["pd"].max_model_len
    body = {"model": MODEL, "prompt": [5] * (limit - 6), "max_tokens": 100_000, "temperature": 0}
    r = httpx.post(apps["url"] + COMPLETIONS, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
