"""`app.api.protocol`: OpenAI request bodies (vLLM's own models) as the API accepts or
refuses them, and the messages the chat template gets."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError
from vllm.exceptions import VLLMValidationError

from app.api.protocol import APIError, ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
REFUSED = (ValidationError, VLLMValidationError, ValueError)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def test_chat_defaults_and_unknown_fields_allowed():
    req = chat(frequency_penalty=0.5, logit_bias={}, some_client_extension=1)
    assert req.n == 1 and req.answer_limit is None
    assert not req.include_usage and req.requested_logprobs is None


@pytest.mark.parametrize("factory", [chat, completion])
@pytest.mark.parametrize("field", ["kv_transfer_params", "ec_transfer_params"])
def test_transfer_params_refused(factory, field):
    params = {"do_remote_prefill": True, "remote_engine_id": "d-1", "remote_block_ids": [[1]]}
    with pytest.raises(ValidationError, match=field):
        factory(**{field: params})
    with pytest.raises(ValidationError, match="reserved for the server"):
        factory(**{field: None})


@pytest.mark.parametrize("factory", [chat, completion])
def test_n_above_one_refused_naming_n(factory):
    with pytest.raises(ValidationError, match="'n' must be 1"):
        factory(n=2)
    assert factory(n=1).n == 1


@pytest.mark.parametrize("factory", [chat, completion])
@pytest.mark.parametrize("field", ["use_beam_search", "prompt_logprobs"])
def test_unsupported_fields_refused(factory, field):
    with pytest.raises(ValidationError, match=field):
        factory(**{field: True if field == "use_beam_search" else 1})


@pytest.mark.parametrize("factory", [chat, completion])
@pytest.mark.parametrize("value", [0, -1, 1.5, "3"])
def test_max_tokens_below_one_refused(factory, value):
    with pytest.raises(ValidationError, match="max_tokens"):
        factory(max_tokens=value)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).answer_limit == 7
    assert chat(max_tokens=5).answer_limit == 5
    with pytest.raises(ValidationError, match="max_completion_tokens"):
        chat(max_completion_tokens=0)


def test_completion_max_tokens_default():
    assert completion().answer_limit == 16
    assert completion(max_tokens=3).answer_limit == 3


@pytest.mark.parametrize("stop", ["", [""], ["a", ""]])
def test_empty_stop_strings_refused(stop):
    with pytest.raises(ValidationError, match="stop"):
        chat(stop=stop)


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**63},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"5": 101}},
        {"logprobs": False, "top_logprobs": 3},
        {"top_logprobs": -2, "logprobs": True},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": []},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
        {"stream_options": {"include_usage": True}},
    ],
    ids=lambda f: ",".join(f),
)
def test_bad_values_refused_before_any_engine(fields):
    with pytest.raises(REFUSED):
        chat(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 3},
        {"frequency_penalty": -3},
        {"temperature": -1},
        {"top_p": 0},
        {"min_p": 2},
        {"repetition_penalty": 0},
    ],
)
def test_vllm_sampling_checks_refuse(fields):
    with pytest.raises(REFUSED):
        chat(**fields).to_sampling_params(8, {})


def test_every_sampling_field_reaches_sampling_params_and_it_pickles():
    req = chat(
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias={"5": 2.0},
        seed=3,
        stop=["END"],
        stop_token_ids=[4],
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=9,
        response_format={"type": "json_object"},
        ignore_eos=True,
        min_tokens=2,
    )
    params = pickle.loads(pickle.dumps(req.to_sampling_params(req.answer_limit, {})))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.9, 7, 0.1)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.1)
    assert params.logit_bias == {5: 2.0} and params.seed == 3 and params.stop == ["END"]
    assert 4 in params.stop_token_ids and params.logprobs == 2 and params.max_tokens == 9
    assert params.structured_outputs.json_object and params.ignore_eos and params.min_tokens == 2


def test_client_token_ids_listed_for_the_vocabulary_check():
    req = chat(stop_token_ids=[1], allowed_token_ids=[2], logit_bias={"3": 1})
    assert {name: list(ids) for name, ids in req.token_ids_to_check()} == {
        "stop_token_ids": [1],
        "allowed_token_ids": [2],
        "logprob_token_ids": [],
        "logit_bias": [3],
    }


def test_include_usage():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ("hello", None)),
        ([1, 2, 3], (None, (1, 2, 3))),
        (["hello"], ("hello", None)),
        ([[4, 5]], (None, (4, 5))),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_text_or_ids() == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], "", 5, [1.5], [-1], [[]], None])
def test_completion_bad_prompts_refused(prompt):
    with pytest.raises(REFUSED):
        completion(prompt=prompt)


def test_completion_echo_refused():
    with pytest.raises(ValidationError, match="echo"):
        completion(echo=True)


def test_completion_logprobs_field():
    assert completion(logprobs=3).requested_logprobs == 3


def messages(*msgs) -> list[dict]:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(msgs)}).template_messages(100)


def test_template_messages_text_parts_joined_and_none_is_empty():
    assert messages(
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    ) == [{"role": "user", "content": "Hello, world"}]
    assert messages({"role": "assistant", "content": None, "name": "bot"}) == [
        {"role": "assistant", "content": "", "name": "bot"}
    ]


def test_template_messages_tool_calls_tool_results_and_reasoning():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    out = messages(
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "look it up"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    )
    assert out[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "look it up",
        "tool_calls": [call],
    }
    assert out[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message, match",
    [
        ({"role": "robot", "content": "x"}, "role"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}, "image_url"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}],
            },
            "name|tool_calls",
        ),
    ],
)
def test_template_messages_refused(message, match):
    with pytest.raises((APIError, ValidationError), match=match):
        messages(message)


def test_template_messages_empty_and_too_many():
    with pytest.raises(APIError, match="empty"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []}).template_messages(10)
    with pytest.raises(APIError, match="at most 2"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": USER * 3}).template_messages(2)


def test_api_error_body():
    err = APIError(400, "too long", param="messages", code="context_length_exceeded")
    assert err.status == 400
    assert err.body() == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
