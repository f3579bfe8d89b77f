"""The agents' APIs' own logic, without engines: Anthropic Messages and OpenAI Responses
requests into chat requests, chat output back into their bodies and stream events, bad
input refused in each API's shape, and the prompt-stability helpers (nonce stripping,
compact tool arguments and grammars)."""

from __future__ import annotations

import json
import re

import pytest

from app.api import chat_output, messages_api, openai_api, responses_api, responses_serving, sessions
from app.api.response_chain import ResponseTurn
from app.errors import APIError, RateLimited

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def chat_completion(message: dict, finish: str = "stop", prompt: int = 100, cached: int = 90) -> dict:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": 7,
            "total_tokens": prompt + 7,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
        "kvturn": {"session_id": "s-1"},
    }


# -- Anthropic Messages ----------------------------------------------------------------------


def test_messages_request_becomes_a_chat_request_without_the_billing_nonce():
    data = {
        "model": "m",
        "max_tokens": 50,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1f2e3;"},
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
            },
        ],
        "tools": [{"name": "w", "description": "weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
    }
    body = messages_api.chat_request(messages_api.parse(data), merge_inline_system=False)
    roles = [m["role"] for m in body.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert body.messages[0]["content"] == "You are terse."
    assert json.loads(body.messages[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert body.tool_choice == "required" and body.stop == ["END"] and body.max_completion_tokens == 50
    assert messages_api.long_retention(data)
    assert not messages_api.long_retention({**data, "system": "plain"})


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": [], "kv_transfer_params": {}}, "kv_transfer_params"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "nope"}]}]}, ""),
    ],
)
def test_bad_messages_requests_are_refused(data, needle):
    with pytest.raises(Exception) as info:
        messages_api.parse(data)
    status, body = messages_api.error_shape(info.value)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and needle in body["error"]["message"]


def test_errors_take_anthropic_shape_by_status():
    assert messages_api.error_shape(APIError(404, "no"))[1]["error"]["type"] == "not_found_error"
    assert messages_api.error_shape(RateLimited("slow down", 3))[1]["error"]["type"] == "rate_limit_error"
    assert messages_api.error_shape(APIError(401, "key"))[1]["error"]["type"] == "authentication_error"
    assert messages_api.error_shape(RuntimeError("boom"))[1]["error"]["type"] == "api_error"


def test_a_chat_answer_becomes_an_anthropic_message_with_cache_reads():
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}
    out = messages_api.message(chat_completion({"role": "assistant", "content": None, "tool_calls": [call]}))
    assert out["type"] == "message" and out["role"] == "assistant" and out["id"].startswith("msg_")
    assert out["stop_reason"] == "tool_use"
    assert out["content"] == [{"type": "tool_use", "id": "call_1", "name": "w", "input": {"city": "Rome"}}]
    assert out["usage"]["cache_read_input_tokens"] == 90 and out["usage"]["input_tokens"] == 10
    text = messages_api.message(chat_completion({"role": "assistant", "content": "hi"}, finish="length"))
    assert text["stop_reason"] == "max_tokens" and text["content"] == [{"type": "text", "text": "hi"}]


def _chunk(delta: dict | None, finish=None, usage=None) -> dict:
    chunk = {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
    }
    if delta is not None:
        chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


async def _collect(events) -> list[dict]:
    return [messages_api.sse_dict(e) async for e in events]


async def test_chat_chunks_become_anthropic_stream_events():
    usage = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
    usage["prompt_tokens_details"] = {"cached_tokens": 80}

    async def chunks():
        yield _chunk({"role": "assistant", "content": ""})
        yield _chunk({"content": "Hel"})
        yield _chunk({"content": "lo"})
        yield _chunk({}, finish="stop")
        yield _chunk(None, usage=usage)

    events = await _collect(messages_api.events(chunks(), 100))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 100 and events[0]["message"]["id"].startswith(
        "msg_"
    )
    assert (
        "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta") == "Hello"
    )
    assert events[5]["delta"]["stop_reason"] == "end_turn"
    assert events[5]["usage"]["cache_read_input_tokens"] == 80 and events[5]["usage"]["input_tokens"] == 20


async def test_a_failure_mid_stream_ends_with_an_anthropic_error_event():
    async def chunks():
        yield _chunk({"role": "assistant", "content": ""})
        yield _chunk({"content": "Hel"})
        raise RateLimited("busy", 2)

    events = await _collect(messages_api.events(chunks(), 10))
    assert events[-1] == {"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}}
    assert "message_stop" not in [e["type"] for e in events]


# -- OpenAI Responses -----------------------------------------------------------------------

TOOLS = [{"type": "function", "name": "w", "description": "weather", "parameters": WEATHER}]


def test_response_ids_keep_their_chain_part():
    first = responses_api.new_id()
    child = responses_api.new_id(first)
    assert first.startswith("resp_") and len(first) == len(child) == 37
    assert child[:21] == first[:21] and child != first
    assert responses_api.new_id("resp_custom")[:21] != "resp_custom"


@pytest.mark.parametrize(
    "data, param",
    [
        ({"model": "m"}, "input"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "tools": ["web_search"]}, "tools.0"),
        ({"input": "hi", "kv_transfer_params": {"x": 1}}, "kv_transfer_params"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_responses_requests_are_refused(data, param):
    with pytest.raises(APIError) as info:
        responses_api.parse(data)
    assert info.value.status == 400 and info.value.param == param


CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}},
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "spawn_agent",
                "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
            }
        ],
    },
    {"type": "web_search", "external_web_access": False},
]


def test_codex_tools_namespace_functions_are_offered_and_hosted_tools_left_out():
    data = {
        "input": "hi",
        "tools": CODEX_TOOLS,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": "thread-1",
        "client_metadata": {"turn_id": "t1"},
    }
    request = responses_api.parse(data)
    assert responses_api.hosted_tools(data) == ["web_search"]
    chat = responses_api.chat_request(request, responses_api.chat_messages(request, None))
    assert [t.function.name for t in chat.tools] == ["exec_command", "multi_agent_v1__spawn_agent"]
    assert chat.prompt_cache_key == "thread-1"
    # The model's call of the flat name goes back as Codex reads it: a namespaced call.
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"message":"go"}'},
            }
        ],
    }
    (item,) = responses_api.output_items(request, message)
    assert item["type"] == "function_call"
    assert (item["name"], item["namespace"], item["call_id"]) == ("spawn_agent", "multi_agent_v1", "call_1")
    # ...and renders as the model wrote it when the history comes back.
    assert responses_api.assistant_message([item])["tool_calls"][0]["function"]["name"] == (
        "multi_agent_v1__spawn_agent"
    )
    follow = responses_api.parse(
        {
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {k: v for k, v in item.items() if k != "id"},
                {"type": "function_call_output", "call_id": "call_1", "output": "agent 7 started"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
            ],
            "tools": CODEX_TOOLS,
        }
    )
    messages = responses_api.chat_messages(follow, None)
    call = next(m for m in messages if m.get("tool_calls"))
    assert call["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


def test_agents_session_keys():
    assert sessions.bounded("thread-1", 256) == "thread-1"
    long = sessions.bounded("x" * 300, 256)
    assert long.startswith("k-") and len(long) <= 256 and long == sessions.bounded("x" * 300, 256)
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "ef8e"})
    assert sessions.claude_code_session({"user_id": user_id}) == "ef8e"
    assert sessions.claude_code_session({"user_id": "user-42"}) is None  # a user, not a session
    assert sessions.claude_code_session({"user_id": "{not json"}) is None
    assert sessions.claude_code_session(None) is None


def test_a_continuation_renders_instructions_history_and_new_items():
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
            ],
        },
    ]
    request = responses_api.parse(
        {
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            "instructions": "Be brief.",
            "previous_response_id": "resp_" + "a" * 32,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": WEATHER}},
            "max_output_tokens": 9,
        }
    )
    assert request.request_id[:21] == "resp_" + "a" * 16
    messages = responses_api.chat_messages(request, history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    body = responses_api.chat_request(request, messages)
    assert body.tool_choice.function.name == "w" and body.max_completion_tokens == 9
    assert body.response_format.json_schema.json_schema == WEATHER
    assert body.tools[0].function.name == "w"


@pytest.mark.parametrize(
    "items, needle",
    [
        ([{"type": "function_call_output", "call_id": "call_x", "output": "?"}], "call_x"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}],
            "input_image",
        ),
        ([], "must not be empty"),
    ],
)
def test_bad_input_items_are_refused(items, needle):
    request = responses_api.parse({"input": items})
    with pytest.raises(APIError) as info:
        responses_api.chat_messages(request, None)
    assert info.value.status == 400 and needle in info.value.message


def test_output_items_and_the_message_the_next_turn_renders():
    request = responses_api.parse({"input": "hi", "tools": TOOLS})
    call = {"id": "call_9", "type": "function", "function": {"name": "w", "arguments": '{"city":"Rome"}'}}
    items = responses_api.output_items(
        request, {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
    )
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[1]["call_id"] == "call_9" and items[1]["arguments"] == '{"city":"Rome"}'
    message = responses_api.assistant_message(items)
    assert message == {"role": "assistant", "content": "Checking.", "tool_calls": [call]}


def test_response_body_validates_against_the_sdk_model():
    from openai.types.responses import Response

    request = responses_api.parse({"input": "hi", "tools": TOOLS, "max_output_tokens": 5})
    params = responses_api.chat_request(request, [{"role": "user", "content": "hi"}]).to_sampling_params(
        5, {}
    )
    usage = chat_completion({})["usage"]
    items = responses_api.output_items(request, {"role": "assistant", "content": "yo"})
    out = responses_api.body(request, params, "m", 1, items, "length", usage, {"session_id": "s"})
    parsed = Response.model_validate(out)
    assert parsed.status == "incomplete" and parsed.output_text == "yo"
    assert parsed.usage.input_tokens_details.cached_tokens == 90 and out["kvturn"] == {"session_id": "s"}


async def test_chat_chunks_become_the_responses_event_sequence():
    request = responses_api.parse({"input": "hi", "tools": TOOLS})
    params = responses_api.chat_request(request, [{"role": "user", "content": "hi"}]).to_sampling_params(
        5, {}
    )
    usage = chat_completion({})["usage"]
    stored = []

    async def chunks():
        yield _chunk({"role": "assistant", "content": ""})
        yield _chunk({"content": "On it."})
        call = {"index": 0, "id": "call_5", "type": "function", "function": {"name": "w", "arguments": ""}}
        yield _chunk({"tool_calls": [call]})
        yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]})
        yield _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]})
        yield {**_chunk({}, finish="tool_calls"), "kvturn": {"session_id": "s"}}
        yield _chunk(None, usage=usage)

    async def store(response):
        stored.append(response)

    stream = responses_api.EventStream(request, params, "m")
    events = [e async for e in responses_serving.events(stream, chunks(), store)]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in events] == list(
        range(len(events))
    )
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"city":"Rome"}'
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_5" and stored == [final]
    assert final["kvturn"] == {"session_id": "s"}


async def test_a_failed_responses_stream_ends_with_response_failed():
    request = responses_api.parse({"input": "hi"})
    params = responses_api.chat_request(request, [{"role": "user", "content": "hi"}]).to_sampling_params(
        5, {}
    )

    async def chunks():
        yield _chunk({"content": "x"})
        raise RuntimeError("engine gone")

    async def store(response):
        raise AssertionError("a failed response is not stored")

    events = [
        e
        async for e in responses_serving.events(
            responses_api.EventStream(request, params, "m"), chunks(), store
        )
    ]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"


# -- prompt stability ------------------------------------------------------------------------


def test_nonce_lines_are_stripped_from_system_text_only():
    patterns = [re.compile(r"^x-anthropic-billing-header:.*(?:\n|$)", re.MULTILINE)]
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=12345;\nYou are terse."},
        {"role": "system", "content": "x-anthropic-billing-header: cch=9;"},
        {"role": "user", "content": "x-anthropic-billing-header: mine"},
    ]
    out = openai_api.strip_system(messages, patterns)
    assert out == [{"role": "system", "content": "You are terse."}, messages[2]]


def test_tool_arguments_in_the_history_are_made_compact():
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "w", "arguments": '{"city": "Zürich", "days": 2}'},
    }
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call, {**call, "function": {"name": "w", "arguments": "not json"}}],
        }
    ]
    out = openai_api.compact_arguments(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == '{"city":"Zürich","days":2}'
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert call["function"]["arguments"] == '{"city": "Zürich", "days": 2}'  # the request is not changed


def test_structural_tags_become_grammars_without_free_whitespace():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from app.api.protocol import ChatCompletionRequest
    from app.api.tokenizer import HFTokenizer
    from app.config import AppConfig
    from tests.conftest import MODEL

    cfg = AppConfig.model_validate({"model": str(MODEL)})
    parsers = openai_api.OutputParsers(cfg, HFTokenizer(cfg.model).hf)
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": WEATHER}}],
            "tool_choice": "required",
        }
    )
    parsers.for_request(body, {})
    params = body.to_sampling_params(64, {})
    openai_api.compact_structural_tag(params)
    grammar = xgr.Grammar.from_structural_tag(params.structured_outputs.structural_tag)
    prefix = '<tool_call>\n{"name": "w", "arguments": '
    assert _is_grammar_accept_string(grammar, prefix + '{"city":"Rome","days":2}}\n</tool_call>')
    for padded in ('{"city": "Rome","days":2}', '{"city":"Rome",\n"days":2}', '{\t"city":"Rome","days":2}'):
        assert not _is_grammar_accept_string(grammar, prefix + padded + "}\n</tool_call>")


def test_whitespace_variants_of_a_tool_call_tag_keep_the_template_s_form():
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [
                {
                    "type": "tag",
                    "begin": "<tool_call>\n{",
                    "content": {"type": "const_string", "value": "x"},
                    "end": "}\n</tool_call>",
                },
                {
                    "type": "tag",
                    "begin": "<tool_call>{",
                    "content": {"type": "const_string", "value": "x"},
                    "end": "}</tool_call>",
                },
                {
                    "type": "tag",
                    "begin": "<tool_call>{",
                    "content": {"type": "const_string", "value": "y"},
                    "end": "}</tool_call>",
                },
            ],
        },
    }

    class Params:
        class structured_outputs:  # noqa: N801 - stands in for vLLM's params object
            structural_tag = json.dumps(tag)

    openai_api.compact_structural_tag(Params)
    tags = json.loads(Params.structured_outputs.structural_tag)["format"]["tags"]
    assert [(t["begin"], t["content"]["value"]) for t in tags] == [
        ("<tool_call>\n{", "x"),
        ("<tool_call>{", "y"),
    ]


def test_json_spaces_are_removed_outside_strings_across_pieces():
    spaces = chat_output.JsonSpaces()
    pieces = ['{"a b": ', '"x \\" y", "c"', ": [1, 2],\n", ' "d": "\\\\"}']
    assert "".join(spaces.feed(p) for p in pieces) == '{"a b":"x \\" y","c":[1,2],"d":"\\\\"}'


def test_a_stored_response_reads_without_this_package():
    """The store's shards unpickle stored responses: nothing in one may name a class of
    `app` (importing it imports vLLM: seconds of a shard's time, past callers' deadlines)."""
    import pickle
    import pickletools

    from app.api.auth import Tenant
    from app.api.shaping import reuse
    from app.config import TenantPolicy
    from app.turn.events import MissReason
    from app.turn.model import TurnResult

    request = responses_api.parse({"input": "hi", "instructions": "Be brief.", "tools": TOOLS})
    messages = responses_api.chat_messages(request, None)
    params = responses_api.chat_request(request, messages).to_sampling_params(5, {})
    result = TurnResult("s-1", "stop", (1, 2), 2, 3, 1, 0, MissReason.PULLED, False, "r1", {"store_s": 0.1})
    items = responses_api.output_items(request, {"role": "assistant", "content": "yo"})
    response = responses_api.body(
        request, params, "m", 1, items, "stop", chat_completion({})["usage"], reuse(result)
    )
    turn = ResponseTurn(request, Tenant("", None, TenantPolicy()), None, False, messages)
    stored, _ = turn.stored(response)
    assert stored.body["kvturn"]["miss_reason"] == "pulled"
    payload = pickle.dumps(stored, protocol=5)
    names = {
        arg
        for op, arg, _ in pickletools.genops(payload)
        if isinstance(arg, str) and op.name.endswith("UNICODE")
    }
    assert not any(name == "app" or name.startswith("app.") for name in names), names
