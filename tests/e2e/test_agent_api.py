"""The agent-facing OpenAI surface, end to end on the real engines (shared `apps`):
tool calls through P/D with the official SDK (named, auto, required; plain and
streaming), reuse across tool-call turns by engine counters, structured output that
validates, logprobs equal to a single engine's, reasoning, and sampling fields that
really reach the decode engine."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.e2e.helpers import MODEL, SYSTEM, delta, engine_stats, reference_tokens

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
LOGS = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "enum": ["/var/log/syslog", "/var/log/auth.log"]},
        "tail": {"type": "boolean"},
    },
    "required": ["path", "tail"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "read_logs", "description": "Read a log file", "parameters": LOGS},
    },
]
SCHEMAS = {"get_weather": WEATHER, "read_logs": LOGS}


def _client(apps, prefix=""):
    import openai

    return openai.OpenAI(base_url=apps["url"] + prefix + "/v1", api_key="unused", max_retries=0)


def _create(client, stream: bool, **kwargs) -> dict:
    """One chat completion through the SDK, streamed or not, as a plain dict of what an
    agent reads: message (content, tool_calls), finish_reason, usage, token ids."""
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    if not stream:
        r = client.chat.completions.create(model=MODEL, temperature=0, extra_body=extra, **kwargs)
        choice = r.choices[0]
        calls = [
            {
                "id": c.id,
                "type": c.type,
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in choice.message.tool_calls or []
        ]
        extras = r.model_extra
        return {
            "content": choice.message.content,
            "reasoning": (choice.message.model_extra or {}).get("reasoning_content"),
            "tool_calls": calls,
            "finish_reason": choice.finish_reason,
            "usage": r.usage.model_dump(),
            "token_ids": choice.model_extra["token_ids"],
            "prompt_token_ids": extras["prompt_token_ids"],
            "logprobs": choice.logprobs,
            "kvturn": extras["kvturn"],
        }
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **kwargs,
        )
    )
    content, reasoning, calls, ids, finish, prompt_ids, kvturn = [], [], {}, [], None, None, None
    for c in chunks:
        extras = c.model_extra or {}
        prompt_ids = extras.get("prompt_token_ids", prompt_ids)
        kvturn = extras.get("kvturn", kvturn)
        for choice in c.choices:
            d = choice.delta
            content.append(d.content or "")
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            for tc in d.tool_calls or []:
                call = calls.setdefault(
                    tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
            finish = choice.finish_reason or finish
    return {
        "content": "".join(content) or None,
        "reasoning": "".join(reasoning) or None,
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "usage": chunks[-1].usage.model_dump(),
        "token_ids": ids,
        "prompt_token_ids": prompt_ids,
        "logprobs": None,
        "kvturn": kvturn,
    }


def _assert_valid_calls(reply: dict, names: set[str]) -> None:
    assert reply["tool_calls"], reply
    for call in reply["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function", reply
        assert call["function"]["name"] in names, reply
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError as exc:
            raise AssertionError(f"arguments are not JSON ({exc}): {reply}") from exc
        jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
    assert reply["finish_reason"] == "tool_calls"


def _ref_reply(apps, messages, **kwargs) -> tuple[list[int], list[int], dict]:
    """Prompt and greedy answer ids of the single-engine `ref` app for the same chat
    request (same rendering, same guided decoding)."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "return_token_ids": True, **kwargs}
    r = httpx.post(apps["url"] + "/ref/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"], r.json()["kvturn"]


def _tokenizer():
    from transformers import AutoTokenizer

    from tests.conftest import MODEL as MODEL_DIR

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "sse"])
def test_sdk_agent_loop_tool_calls_through_pd_reuse_history(apps, stream):
    client = _client(apps)
    block = apps["pd"].block_size
    question = f"Check the weather in Paris and read the syslog ({'stream' if stream else 'plain'})."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    turns = [
        dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=160),
        dict(tool_choice="auto", max_tokens=24),
        # One call: the random-weight model would otherwise go on calling until max_tokens.
        dict(tool_choice="required", max_tokens=160, parallel_tool_calls=False),
    ]
    reuse = []
    tok = _tokenizer()
    prev_prompt = None  # prompt tokens of the previous turn (set at the end of each turn)
    for i, choice in enumerate(turns):
        before = engine_stats("PrefillServer")
        reply = _create(client, stream, messages=messages, tools=TOOLS, **choice)
        after = engine_stats("PrefillServer")
        assert reply["token_ids"] and reply["usage"]["completion_tokens"] == len(reply["token_ids"])
        # The same request to one engine: the same prompt and greedy tokens, or (a turn
        # spliced by token-in/token-out: tool calls re-render as generated, with compact
        # arguments) the same prompt text.
        ref_prompt, ref_answer, ref_kv = _ref_reply(apps, messages, tools=TOOLS, **choice)
        if reply["prompt_token_ids"] == ref_prompt:
            assert reply["token_ids"] == ref_answer, (i, reply)
        else:
            # Spliced on one side only (the ref app continues its own earlier answers): the
            # same text, with an earlier answer's generated tokens where the other side
            # tokenized its text again.
            assert reply["kvturn"]["spliced"] or ref_kv["spliced"], (i, reply["kvturn"], ref_kv)
            # (An answer that ended inside a UTF-8 character: its text lacks those bytes.)
            text = lambda ids: tok.decode(ids).replace("\ufffd", "")  # noqa: E731
            assert text(reply["prompt_token_ids"]) == text(ref_prompt), i
        if choice["tool_choice"] == "auto":
            if reply["tool_calls"]:
                _assert_valid_calls(reply, set(SCHEMAS))
            else:
                assert reply["finish_reason"] in ("length", "stop") and reply["content"]
            # Unconstrained: greedy tokens equal one engine's on the same prompt ids.
            assert reply["token_ids"] == reference_tokens(
                apps["url"], reply["prompt_token_ids"], len(reply["token_ids"])
            ), (i, reply)
        else:
            # Guided by the grammar of the named tool or of any tool: schema-valid calls.
            names = {"get_weather"} if isinstance(choice["tool_choice"], dict) else set(SCHEMAS)
            _assert_valid_calls(reply, names)
        if i > 0:
            # The history (tool calls and results re-rendered by the template) came from decode.
            pulled = delta(after, before)["prompt_tokens_external"]
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert pulled >= prev_prompt - 2 * block, (pulled, prev_prompt)
            assert cached >= pulled
            reuse.append(round(cached / reply["usage"]["prompt_tokens"], 3))
        prev_prompt = reply["usage"]["prompt_tokens"]
        assistant = {"role": "assistant", "content": reply["content"]}
        if reply["tool_calls"]:
            assistant["tool_calls"] = reply["tool_calls"]
        messages = messages + [assistant]
        for call in reply["tool_calls"]:
            result = {
                "get_weather": '{"temp": 21, "sky": "clear"}',
                "read_logs": "error: file not found; info: retrying in 5 seconds",
            }
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": result[call["function"]["name"]] * 8}
            )
        if not reply["tool_calls"]:
            messages.append({"role": "user", "content": "Now read the logs, please."})
    print(f"\ntool-call turns reuse (cached/prompt) {'sse' if stream else 'plain'}: {reuse}")


def test_response_format_json_schema_validates(apps):
    schema = {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "failed"]},
            "retry": {"type": "boolean"},
            "code": {"type": "integer", "enum": [200, 404, 500]},
        },
        "required": ["status", "retry", "code"],
        "additionalProperties": False,
    }
    client = _client(apps)
    messages = [{"role": "user", "content": "Report the build status as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "status", "schema": schema}}
    for stream in (False, True):
        reply = _create(client, stream, messages=messages, max_tokens=160, response_format=fmt)
        jsonschema.validate(json.loads(reply["content"]), schema)
        assert reply["finish_reason"] == "stop"
    # Completions take it too.
    r = httpx.post(
        apps["url"] + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "status:",
            "max_tokens": 160,
            "temperature": 0,
            "response_format": fmt,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


def _ref_logprobs(apps, prompt_ids, n, k):
    r = httpx.post(
        apps["url"] + "/ref/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt_ids,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": k,
            "return_token_ids": True,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_logprobs_openai_shaped_and_equal_to_single_engine(apps):
    url = apps["url"]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Summarise the syslog with probabilities."},
    ]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 12
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][-1]["logprob"]
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-6)  # greedy
    ref = _ref_logprobs(apps, out["prompt_token_ids"], 12, 3)
    assert ref["token_ids"] == choice["token_ids"]
    for mine, theirs in zip(content, ref["logprobs"]["token_logprobs"], strict=False):
        assert abs(mine["logprob"] - theirs) < 1e-3
    # Streaming: the same logprobs, chunk by chunk.
    streamed = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed.extend((c.get("logprobs") or {}).get("content") or [])
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(streamed, content, strict=False))
    # Completions: the legacy shape.
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": out["prompt_token_ids"],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 2,
        },
        timeout=300,
    )
    legacy = r.json()["choices"][0]["logprobs"]
    assert set(legacy) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"]) == 6
    assert all(len(top) <= 2 for top in legacy["top_logprobs"])
    assert legacy["token_logprobs"] == pytest.approx(ref["logprobs"]["token_logprobs"][:6], abs=1e-3)


def test_sampling_fields_reach_the_decode_engine(apps):
    """logit_bias, stop_token_ids, min_tokens and seed change what decode produces."""
    url = apps["url"]
    messages = [{"role": "user", "content": "Tell me about the repository."}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    plain = httpx.post(url + "/v1/chat/completions", json=base, timeout=300).json()["choices"][0]["token_ids"]
    forced = 42 if plain[0] != 42 else 43
    biased = httpx.post(
        url + "/v1/chat/completions", json={**base, "logit_bias": {str(forced): 100}}, timeout=300
    ).json()
    assert biased["choices"][0]["token_ids"] == [forced] * 8
    stopped = httpx.post(
        url + "/v1/chat/completions",
        json={**base, "stop_token_ids": [plain[2]], "min_tokens": 0},
        timeout=300,
    ).json()["choices"][0]
    assert (
        stopped["token_ids"][-1] == plain[2]
        and stopped["finish_reason"] == "stop"
        and len(stopped["token_ids"]) <= 3
    )
    sampled = {
        **base,
        "temperature": 1.5,
        "top_k": 50,
        "seed": 7,
        "presence_penalty": 1.0,
        "repetition_penalty": 1.2,
    }
    a = httpx.post(url + "/v1/chat/completions", json=sampled, timeout=300).json()["choices"][0]["token_ids"]
    b = httpx.post(url + "/v1/chat/completions", json=sampled, timeout=300).json()["choices"][0]["token_ids"]
    assert a == b  # seeded


def test_reasoning_content_and_reuse_when_client_drops_it(apps):
    url = apps["url"]
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Think about the weather in Oslo first."},
    ]
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": True,
        **thinking,
    }
    # A session header: the next prompt does not extend this one (its answer is rendered
    # without the reasoning), so only the session names the conversation.
    headers = {"x-session-id": "reasoning-dropped"}
    first = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300).json()
    message = first["choices"][0]["message"]
    # The generation prompt opened <think>: the (random) model's words are reasoning until </think>.
    assert message["reasoning_content"]
    text = message["reasoning_content"] + (message["content"] or "")
    assert len(text) > 0
    streamed = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["delta"].get("reasoning_content") or ""
    assert streamed == message["reasoning_content"]
    # Next turn: the client keeps only the content (as many do); the answer is still the
    # single engine's answer to the same prompt, and the history before the answer is reused.
    history = messages + [
        {"role": "assistant", "content": message["content"] or ""},
        {"role": "user", "content": "And in Rome?"},
    ]
    before = engine_stats("PrefillServer")
    second = httpx.post(
        url + "/v1/chat/completions", json={**body, "messages": history}, headers=headers, timeout=300
    ).json()
    pulled = delta(engine_stats("PrefillServer"), before)["prompt_tokens_external"]
    ids = second["choices"][0]["token_ids"]
    assert ids == reference_tokens(url, second["prompt_token_ids"], len(ids))
    prompt = second["usage"]["prompt_tokens"]
    assert pulled >= first["usage"]["prompt_tokens"] - 2 * apps["pd"].block_size
    print(
        f"\nreasoning dropped by the client: reused {pulled}/{prompt} prompt tokens ({pulled / prompt:.0%})"
    )
