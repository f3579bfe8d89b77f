"""`app.protocol`: OpenAI request bodies as the API accepts or refuses them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def test_chat_defaults_and_unknown_fields_allowed():
    req = chat(frequency_penalty=0.5, logit_bias={})
    assert req.n == 1 and req.max_tokens is None and req.answer_limit is None
    assert req.stop_list == ()
    assert not req.include_usage


@pytest.mark.parametrize("factory", [chat, completion])
def test_kv_transfer_params_refused(factory):
    params = {"do_remote_prefill": True, "remote_engine_id": "d-1", "remote_block_ids": [[1]]}
    with pytest.raises(ValidationError, match="kv_transfer_params"):
        factory(kv_transfer_params=params)
    with pytest.raises(ValidationError, match="reserved for the server"):
        factory(kv_transfer_params=None)


@pytest.mark.parametrize("factory", [chat, completion])
def test_n_above_one_refused(factory):
    with pytest.raises(ValidationError, match="n"):
        factory(n=2)
    assert factory(n=1).n == 1


@pytest.mark.parametrize("factory", [chat, completion])
@pytest.mark.parametrize("value", [0, -1])
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


def test_stop_forms():
    assert chat(stop="x").stop_list == ("x",)
    assert chat(stop=["a", "b"]).stop_list == ("a", "b")


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


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [], "", 5, [1.5]])
def test_completion_bad_prompts_refused(prompt):
    with pytest.raises(ValidationError):
        completion(prompt=prompt)


def test_completion_multiple_prompts_message():
    with pytest.raises(ValidationError, match="one prompt per request"):
        completion(prompt=["a", "b"])


def test_completion_echo_refused():
    with pytest.raises(ValidationError, match="echo"):
        completion(echo=True)


def test_chat_needs_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "robot", "content": "x"}]})


def test_content_text_parts_are_joined():
    msg = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    )
    assert msg.for_template() == {"role": "user", "content": "Hello, world"}


def test_content_none_is_empty_and_extras_kept():
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "name": "bot"})
    assert msg.for_template() == {"role": "assistant", "content": "", "name": "bot"}
    assert ChatMessage(role="user", content="plain").for_template() == {"role": "user", "content": "plain"}


def test_content_other_part_types_refused():
    msg = ChatMessage.model_validate(
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x"}}],
        }
    )
    with pytest.raises(ValueError, match="image_url"):
        msg.for_template()


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
