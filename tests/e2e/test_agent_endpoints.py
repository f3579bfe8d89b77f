"""The agents' own APIs end to end on the real engines (shared `apps`): OpenAI's Responses
chained by `previous_response_id` and Anthropic's Messages, both through the official
SDKs, with reuse proven by the engines' counters and answers equal to the single-engine
`ref` app's; forks, stored responses, compact constrained JSON, and bad input in each
API's own error shape."""

from __future__ import annotations

import concurrent.futures
import json
import uuid

import httpx
import jsonschema
import pytest

from tests.e2e.helpers import MODEL, SYSTEM, chat, delta, engine_stats

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER}
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
RESULT = '{"temp": 21, "sky": "clear", "wind": "light"}' * 6


def _openai(apps, prefix=""):
    import openai

    return openai.OpenAI(base_url=apps["url"] + prefix + "/v1", api_key="unused", max_retries=0)


def _anthropic(apps, prefix=""):
    import anthropic

    return anthropic.Anthropic(base_url=apps["url"] + prefix, api_key="unused", max_retries=0)


def _compact(text: str) -> bool:
    """No whitespace outside JSON strings."""
    return text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def _pulled(before: dict) -> int:
    return delta(engine_stats("PrefillServer"), before)["prompt_tokens_external"]


def _respond(client, stream: bool, **kwargs):
    """One response through the SDK; a streamed one as its final response and event types."""
    common = dict(model=MODEL, instructions=SYSTEM, tools=TOOLS, temperature=0)
    if not stream:
        return client.responses.create(**common, **kwargs), None
    events = list(client.responses.create(**common, stream=True, **kwargs))
    return events[-1].response, events


def _summary(response) -> list:
    return [
        (item.type, getattr(item, "name", None), getattr(item, "arguments", None))
        if item.type == "function_call"
        else (item.type, response.output_text)
        for item in response.output
    ]


def test_responses_chain_reuses_history_and_answers_as_one_engine(apps):
    """Codex-style loop: a forced call, its output chained by previous_response_id, then a
    streamed turn. Turns 2 and 3 reuse >= 90% of the history they extend (the prefill
    engine pulled it from decode), and every answer equals the single-engine app's."""
    pd, ref = _openai(apps), _openai(apps, "/ref")
    turns = [
        dict(input="Check the weather in Paris.", tool_choice={"type": "function", "name": "get_weather"}),
        dict(input=None, max_output_tokens=24),
        dict(input="And for the next days?", max_output_tokens=24),
    ]
    previous = {"pd": None, "ref": None}
    history = 0
    for i, turn in enumerate(turns):
        stream = i == 2
        answers = {}
        for name, client in (("pd", pd), ("ref", ref)):
            kwargs = {"max_output_tokens": 96, **turn}
            if i == 1:  # the call's output, for the call this chain made
                call = next(o for o in previous[name].output if o.type == "function_call")
                kwargs["input"] = [
                    {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
                ]
            if previous[name] is not None:
                kwargs["previous_response_id"] = previous[name].id
            before = engine_stats("PrefillServer") if name == "pd" else None
            response, events = _respond(client, stream, **kwargs)
            if before is not None:
                answers["pulled"] = _pulled(before)
            answers[name] = response
            if events is not None:
                kinds = [e.type for e in events]
                assert kinds[:2] == ["response.created", "response.in_progress"], kinds
                assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
                assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
                numbers = [e.sequence_number for e in events]
                assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
            previous[name] = response
        mine, theirs = answers["pd"], answers["ref"]
        assert _summary(mine) == _summary(theirs), (i, _summary(mine), _summary(theirs))
        if i == 0:
            (call,) = [o for o in mine.output if o.type == "function_call"]
            assert call.name == "get_weather" and mine.status == "completed"
            jsonschema.validate(json.loads(call.arguments), WEATHER)
            assert _compact(call.arguments), call.arguments
        else:
            cached = mine.usage.input_tokens_details.cached_tokens
            assert cached >= 0.9 * history, (i, cached, history)
            assert answers["pulled"] >= 0.9 * history - 2 * apps["pd"].block_size, (i, answers["pulled"])
            assert mine.model_extra["kvturn"]["miss_reason"] is None
        history = mine.usage.input_tokens + mine.usage.output_tokens
    # The stored chain: retrievable, its input items listed, and deletable.
    last = previous["pd"]
    assert pd.responses.retrieve(last.id).output_text == last.output_text
    items = pd.responses.input_items.list(last.id).data
    assert [i.type for i in items] == ["message"] and items[0].content[0].text == "And for the next days?"


def test_forks_of_one_response_both_answer_each_in_its_own_session(apps):
    pd, ref = _openai(apps), _openai(apps, "/ref")
    roots = {
        name: client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            input="Plan a trip to Oslo.",
            max_output_tokens=16,
            temperature=0,
        )
        for name, client in (("pd", pd), ("ref", ref))
    }
    questions = ["What should I pack?", "Which month is best?"]

    def branch(name: str, question: str):
        client = pd if name == "pd" else ref
        return client.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            previous_response_id=roots[name].id,
            input=question,
            max_output_tokens=12,
            temperature=0,
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        forks = list(pool.map(lambda q: branch("pd", q), questions))
    for fork, question in zip(forks, questions, strict=True):
        assert fork.output_text == branch("ref", question).output_text
    sessions = {f.model_extra["kvturn"]["session_id"] for f in forks}
    assert len(sessions) == 2 and roots["pd"].model_extra["kvturn"]["session_id"] in sessions
    # Each fork's chain goes on with its own KV.
    for fork in forks:
        nxt = pd.responses.create(
            model=MODEL,
            instructions=SYSTEM,
            previous_response_id=fork.id,
            input="Thanks.",
            max_output_tokens=8,
            temperature=0,
        )
        history = fork.usage.input_tokens + fork.usage.output_tokens
        assert nxt.usage.input_tokens_details.cached_tokens >= 0.9 * history


def test_deleting_a_response_ends_its_session_and_its_chain(apps):
    pd = _openai(apps)
    first = pd.responses.create(
        model=MODEL, input="Remember the number 7.", max_output_tokens=8, temperature=0
    )
    session = first.model_extra["kvturn"]["session_id"]
    r = httpx.delete(apps["url"] + f"/v1/responses/{first.id}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "response", "deleted": True}
    assert httpx.get(apps["url"] + f"/v1/responses/{first.id}", timeout=30).status_code == 404
    gone = httpx.post(
        apps["url"] + "/v1/responses",
        json={"model": MODEL, "input": "Which number?", "previous_response_id": first.id},
        timeout=60,
    )
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "previous_response_not_found"
    # Its KV handle went with it: the session's next turn finds no conversation.
    messages = [{"role": "user", "content": "Remember the number 7."}]
    assert (
        chat(apps["url"], messages, session=session, max_tokens=4).kvturn["miss_reason"] == "no_conversation"
    )
    # store: false answers without keeping anything.
    loose = pd.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=4, temperature=0)
    assert httpx.get(apps["url"] + f"/v1/responses/{loose.id}", timeout=30).status_code == 404


def _system(nonce: bool = True) -> list[dict]:
    """Claude Code's system blocks: a billing line with a per-request nonce, then the prompt."""
    blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    if nonce:
        line = f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={uuid.uuid4().hex[:5]};"
        blocks.insert(0, {"type": "text", "text": line})
    return blocks


def _message(client, stream: bool, **kwargs):
    common = dict(model=MODEL, tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0})
    if not stream:
        return client.messages.create(system=_system(), **common, **kwargs)
    with client.messages.stream(system=_system(), **common, **kwargs) as events:
        return events.get_final_message()


def test_messages_tool_loop_reuses_history_despite_the_nonce(apps):
    """Claude-Code-style loop without a session header: a forced tool_use, its
    tool_result, then a streamed turn. The nonce in the first system block changes on every
    request; turns 2 and 3 still read >= 90% of the history from cache (pulled from decode),
    and every answer equals the single-engine app's."""
    pd, ref = _anthropic(apps), _anthropic(apps, "/ref")
    conversation = {"pd": [{"role": "user", "content": "Weather in Rome for 2 days?"}]}
    conversation["ref"] = list(conversation["pd"])
    turns = [
        dict(max_tokens=96, tool_choice={"type": "tool", "name": "get_weather"}),
        dict(max_tokens=24),
        dict(max_tokens=24),
    ]
    history = 0
    for i, turn in enumerate(turns):
        answers = {}
        for name, client in (("pd", pd), ("ref", ref)):
            before = engine_stats("PrefillServer") if name == "pd" else None
            answers[name] = _message(client, i == 2, messages=conversation[name], **turn)
            if before is not None:
                answers["pulled"] = _pulled(before)
        mine, theirs = answers["pd"], answers["ref"]
        dump = lambda m: [b.model_dump(exclude_none=True) for b in m.content]  # noqa: E731
        strip_ids = lambda blocks: [{k: v for k, v in b.items() if k != "id"} for b in blocks]  # noqa: E731
        assert strip_ids(dump(mine)) == strip_ids(dump(theirs)), (i, dump(mine), dump(theirs))
        assert mine.stop_reason == theirs.stop_reason
        usage = mine.usage
        if i == 0:
            (use,) = [b for b in mine.content if b.type == "tool_use"]
            assert mine.stop_reason == "tool_use" and use.name == "get_weather"
            jsonschema.validate(use.input, WEATHER)
        else:
            assert usage.cache_read_input_tokens >= 0.9 * history, (i, usage, history)
            assert answers["pulled"] >= 0.9 * history - 2 * apps["pd"].block_size, (i, answers["pulled"])
        history = usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens
        for name in ("pd", "ref"):
            reply = answers[name]
            conversation[name] = conversation[name] + [{"role": "assistant", "content": dump(reply)}]
            uses = [b for b in reply.content if b.type == "tool_use"]
            if uses:
                results = [{"type": "tool_result", "tool_use_id": b.id, "content": RESULT} for b in uses]
                conversation[name].append({"role": "user", "content": results})
            else:
                conversation[name].append({"role": "user", "content": "And tomorrow?"})
    count = pd.messages.count_tokens(
        model=MODEL, system=_system(), messages=conversation["pd"], tools=ANTHROPIC_TOOLS
    )
    assert count.input_tokens > history


def test_constrained_json_is_compact_without_logit_bias(apps):
    """Forced tool arguments and json_schema answers, plain and streamed, on every API:
    no whitespace outside strings, and json_schema answers fit in 64 tokens."""
    status = {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["ok", "failed"]},
            "code": {"type": "integer", "minimum": 100, "maximum": 599},
            "retry": {"type": "boolean"},
        },
        "required": ["status", "code", "retry"],
        "additionalProperties": False,
    }
    import openai

    client = openai.OpenAI(base_url=apps["url"] + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Report the build status as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "status", "schema": status}}
    for stream in (False, True):
        if stream:
            chunks = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=64, response_format=fmt, temperature=0, stream=True
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=64, response_format=fmt, temperature=0
            )
            assert reply.choices[0].finish_reason == "stop"
            text = reply.choices[0].message.content
        jsonschema.validate(json.loads(text), status)
        assert _compact(text), text
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        if stream:
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=96,
                tools=tools,
                tool_choice=named,
                temperature=0,
                stream=True,
            )
            arguments = "".join(
                tc.function.arguments or ""
                for c in chunks
                if c.choices
                for tc in c.choices[0].delta.tool_calls or []
            )
        else:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=96, tools=tools, tool_choice=named, temperature=0
            )
            arguments = reply.choices[0].message.tool_calls[0].function.arguments
        jsonschema.validate(json.loads(arguments), WEATHER)
        assert _compact(arguments), arguments
        # The Responses API's text.format.
        response, _ = _respond(
            client,
            stream,
            input="Report the build status.",
            text={"format": {"type": "json_schema", "name": "status", "schema": status}},
            max_output_tokens=64,
        )
        assert response.status == "completed" and _compact(response.output_text), response.output_text
        jsonschema.validate(json.loads(response.output_text), status)


RESPONSES_BAD = [
    ({}, "input"),
    ({"input": "hi", "previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, "input"),
    (
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
                }
            ]
        },
        "input",
    ),
    ({"input": "hi", "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": ["web_search"]}, "tools.0"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, None),
    ({"input": "hi", "top_p": 7}, None),
    ({"input": 42}, None),
    ({"input": [{"type": "nonsense"}]}, None),
    ({"input": "hi", "model": "gpt-7"}, "model"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "missing"}, "tools": TOOLS}, None),
    (
        {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
        None,
    ),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "logit_bias": {"99999999": 5}}, None),
    ({"input": "hi", "reasoning": {"effort": "galactic"}}, None),
    ({"input": "\ud800"}, None),
]

MESSAGES_BAD = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8}, "messages"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, None),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "sticker"}]}]}, None),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, None),
    ({"max_tokens": "lots", "messages": [{"role": "user", "content": "hi"}]}, None),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {}},
        "kv_transfer",
    ),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": "warm"}, None),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "magic"}},
        None,
    ),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "x"}]}, None),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "model": "claude-9"}, "claude-9"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": [""]}, None),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "top_p": 3}, None),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "system": 5}, None),
    ({"max_tokens": 8, "messages": "hi"}, None),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": None}]}, None),
    (
        {
            "max_tokens": 8,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
                        }
                    ],
                }
            ],
        },
        None,
    ),
    (
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}},
        None,
    ),
    ({"max_tokens": "lots", "messages": [{"role": "user", "content": "hi"}]}, None),
    (
        {
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "t", "input_schema": {"type": "nope"}}],
            "tool_choice": {"type": "any"},
        },
        None,
    ),
]


def test_bad_input_answers_4xx_in_each_api_s_shape_and_the_server_keeps_serving(apps):
    url = apps["url"]
    assert len(RESPONSES_BAD) >= 20 and len(MESSAGES_BAD) >= 20
    for body, param in RESPONSES_BAD:
        raw = json.dumps({"model": MODEL, **body}) if "\ud800" not in str(body) else '{"input": "\\ud800"}'
        r = httpx.post(
            url + "/v1/responses", content=raw, headers={"content-type": "application/json"}, timeout=60
        )
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["type"] and error["message"], (body, error)
        if param is not None:
            assert error["param"] == param or param in error["message"], (body, error)
    for body, needle in MESSAGES_BAD:
        r = httpx.post(url + "/v1/messages", json={"model": MODEL, **body}, timeout=60)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        out = r.json()
        assert out["type"] == "error" and out["error"]["type"].endswith("_error"), (body, out)
        if needle is not None:
            assert needle in out["error"]["message"], (body, out)
    oversize = httpx.post(
        url + "/v1/messages",
        content=b'{"max_tokens": 8, "messages": [{"role": "user", "content": "' + b"x" * (5 << 20) + b'"}]}',
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert oversize.status_code == 413 and oversize.json()["error"]["type"] == "request_too_large"
    # Still serving both.
    ok = httpx.post(
        url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4}, timeout=120
    )
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")
    ok = httpx.post(
        url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "ignored-without-keys"},
        timeout=120,
    )
    assert ok.status_code == 200 and ok.json()["type"] == "message"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_handle_callers_get_the_same_apis(apps, api):
    from ray import serve

    handle = serve.get_deployment_handle("Ingress", "pd")
    if api == "responses":
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0}
        whole = handle.responses.remote(body).result()
        events = list(handle.options(stream=True).responses_stream.remote({**body, "stream": True}))
        text = lambda output: [part["text"] for item in output for part in item.get("content", [])]  # noqa: E731
        assert whole["object"] == "response" and events[-1]["type"] in (
            "response.completed",
            "response.incomplete",
        )
        assert text(events[-1]["response"]["output"]) == text(whole["output"])
    else:
        body = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
        }
        whole = handle.messages.remote(body).result()
        events = list(handle.options(stream=True).messages_stream.remote({**body, "stream": True}))
        assert whole["type"] == "message" and events[0]["type"] == "message_start"
        assert events[-1]["type"] == "message_stop"
