"""`app.api.openai_api`: request bodies within limits, errors as OpenAI bodies, vLLM's tool and
reasoning parsers over the embedded model's output, logprobs in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from app import errors
from app.api import chat_output, openai_api
from app.api.protocol import APIError, ChatCompletionRequest
from app.config import AppConfig
from app.engines.wire import TokenLogprob
from tests.conftest import MODEL

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


class _Request:
    def __init__(self, body: bytes, headers: dict | None = None, pieces: int = 4):
        self.headers = headers if headers is not None else {"content-length": str(len(body))}
        self._body, self._pieces = body, pieces
        self.read = 0

    async def stream(self):
        step = max(1, len(self._body) // self._pieces)
        for i in range(0, len(self._body), step):
            self.read += step
            yield self._body[i : i + step]


def read(body: bytes, limit: int = 1000, headers: dict | None = None):
    return asyncio.run(openai_api.read_body(_Request(body, headers), limit))


def test_read_body_parses_an_object():
    assert read(b'{"a": [1, {"b": "c"}]}') == {"a": [1, {"b": "c"}]}


def test_read_body_too_large_by_header_is_413_without_reading():
    request = _Request(b"x" * 5000)
    with pytest.raises(APIError) as err:
        asyncio.run(openai_api.read_body(request, 1000))
    assert err.value.status == 413 and request.read == 0


def test_read_body_too_large_without_header_stops_reading():
    request = _Request(b"x" * 5000, headers={}, pieces=50)
    with pytest.raises(APIError) as err:
        asyncio.run(openai_api.read_body(request, 1000))
    assert err.value.status == 413 and request.read <= 1100


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1]",
        b"",
        b'{"a": "\\ud800"}',
        b'{"\\udfff": 1}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"a": ' + b"9" * 5000 + b"}",
        b'{"a": "\xff"}',
    ],
    ids=[
        "malformed",
        "array",
        "empty",
        "surrogate",
        "surrogate_key",
        "deep",
        "deeper_than_limit",
        "huge_int",
        "bad_utf8",
    ],
)
def test_parse_json_refuses_with_400(raw):
    with pytest.raises(APIError) as err:
        openai_api.parse_json(raw)
    assert err.value.status == 400


def test_error_bodies():
    from vllm.exceptions import VLLMValidationError

    status, body = errors.error_body(VLLMValidationError("bad top_p", parameter="top_p"))
    assert status == 400 and body["error"]["param"] == "top_p" and body["error"]["message"] == "bad top_p"
    status, body = errors.error_body(HTTPException(405, "Method Not Allowed"))
    assert status == 405 and body["error"]["message"] == "Method Not Allowed"
    status, body = errors.error_body(
        RequestValidationError([{"loc": ("body", "messages"), "msg": "Field required", "type": "missing"}])
    )
    assert status == 400 and body["error"]["param"] == "messages"
    assert errors.error_body(errors.client_error(ValueError("presence_penalty must be in [-2, 2]")))[0] == 400
    assert errors.error_body(ValueError("internal"))[0] == 500
    assert errors.error_body(RuntimeError("boom"))[1]["error"]["type"] == "server_error"
    # A store that cannot answer a request about it (ending a session) is a 503, not a 500.
    from connector.store_api import StoreUnavailable

    status, body = errors.error_body(StoreUnavailable("shard restarting"))
    assert status == 503 and body["error"]["code"] == "store_unavailable"
    # Handle callers get the exception an HTTP client would get as a body.
    as_error = errors.as_api_error(errors.client_error(ValueError("top_k must be -1 or >= 1")))
    assert (as_error.status, as_error.type) == (400, "invalid_request_error")
    assert errors.as_api_error(StoreUnavailable("x")).code == "store_unavailable"


def test_template_kwargs_defaults_and_reserved_names():
    cfg = AppConfig.model_validate(
        {"model": str(MODEL), "openai": {"chat_template_kwargs": {"enable_thinking": False}}}
    )
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": 1}}
    )
    assert openai_api.template_kwargs(cfg, body) == {"enable_thinking": False, "x": 1}
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}}
    )
    with pytest.raises(APIError, match="tokenize"):
        openai_api.template_kwargs(cfg, body)


def test_default_tool_parser_by_family():
    assert openai_api.default_tool_parser(AppConfig.model_validate({"model": "Qwen/Qwen3-8B"})) == "hermes"
    assert openai_api.default_tool_parser(AppConfig.model_validate({"model": str(MODEL)})) == "hermes"
    assert (
        openai_api.default_tool_parser(AppConfig.model_validate({"model": "meta-llama/Llama-3.1-8B"})) is None
    )


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def parsers(tok):
    cfg = AppConfig.model_validate(
        {
            "model": str(MODEL),
            "openai": {"reasoning_parser": "qwen3", "chat_template_kwargs": {"enable_thinking": False}},
        }
    )
    return cfg, openai_api.OutputParsers(cfg, tok)


def request(parsers, **fields):
    cfg, ps = parsers
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})
    return body, ps.for_request(body, openai_api.template_kwargs(cfg, body))


def test_embedded_model_has_single_markup_tokens(tok):
    for marker in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    assert "<tool_call>" in tok.decode(tok.encode(CALL), skip_special_tokens=True)


def test_chat_template_renders_tools_calls_results_and_reasoning(tok):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "the tool said so"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools") and '"name": "get_weather"' in text
    # The call renders exactly as the model generates it (so token-in/token-out splices).
    assert "<|im_start|>assistant\n" + CALL + "<|im_end|>\n" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert "<think>\nthe tool said so\n</think>\n\nIt is sunny.<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    thinking = tok.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")


def test_plain_answer_passes_through_the_parsers(parsers, tok):
    body, parser = request(parsers)
    assert chat_output.chat_message(parser, True, body, "hello world", tok.encode("hello world")) == (
        {"role": "assistant", "content": "hello world"},
        False,
    )
    stream = chat_output.ChatStream(parser, body, [1, 2])
    assert [stream.delta(t, tok.encode(t)) for t in ("hel", "lo")] == [{"content": "hel"}, {"content": "lo"}]


@pytest.mark.parametrize(
    "choice",
    ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["auto", "required", "named"],
)
def test_tool_calls_parsed_and_constrained(parsers, tok, choice):
    body, parser = request(parsers, tools=TOOLS, tool_choice=choice)
    # vLLM's parser turned the tool choice into a structural tag for guided decoding,
    # with the tool's argument schema pinned.
    tag = json.loads(body.to_sampling_params(8, {}).structured_outputs.structural_tag)
    assert '"enum": ["Paris", "Rome"]' in json.dumps(tag)
    message, called = chat_output.chat_message(parser, True, body, CALL, tok.encode(CALL))
    assert called and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Rome"}',
    }
    assert chat_output.finish_reason("stop", called) == "tool_calls"
    assert chat_output.finish_reason("length", called) == "length"


def test_tool_calls_streamed(parsers, tok):
    body, parser = request(parsers, tools=TOOLS)
    stream = chat_output.ChatStream(parser, body, [1, 2])
    deltas = [stream.delta(tok.decode([i]), [i]) for i in tok.encode("ok " + CALL)]
    deltas.append(stream.delta("", [], finished=True))
    calls = [tc for d in deltas if d for tc in d.get("tool_calls", [])]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == '{"city": "Rome"}'
    assert stream.called_tools


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_the_first_call(parsers, tok, parallel):
    two = CALL + "\n" + CALL.replace("Rome", "Paris")
    body, parser = request(parsers, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    if not parallel:  # vLLM's parser also stops the grammar after one call
        assert '"stop_after_first":true' in body.to_sampling_params(
            8, {}
        ).structured_outputs.structural_tag.replace(" ", "")
    message, called = chat_output.chat_message(parser, True, body, two, tok.encode(two))
    assert called and len(message["tool_calls"]) == (2 if parallel else 1)
    body, parser = request(parsers, tools=TOOLS, parallel_tool_calls=parallel)
    stream = chat_output.ChatStream(parser, body, [1, 2])
    deltas = [stream.delta(tok.decode([i]), [i]) for i in tok.encode(two)]
    deltas.append(stream.delta("", [], finished=True))
    indexes = {tc["index"] for d in deltas if d for tc in d.get("tool_calls", [])}
    assert indexes == ({0, 1} if parallel else {0})


def test_tool_choice_none_leaves_markup_as_content(parsers, tok):
    body, parser = request(parsers, tools=TOOLS, tool_choice="none")
    message, called = chat_output.chat_message(parser, True, body, CALL, tok.encode(CALL))
    assert not called and message["content"] == CALL


def test_reasoning_split_when_thinking(parsers, tok):
    out = "some thought</think>\n\nthe answer"
    body, parser = request(parsers, chat_template_kwargs={"enable_thinking": True})
    message, _ = chat_output.chat_message(parser, True, body, out, tok.encode(out))
    assert message["reasoning_content"] == "some thought" and message["content"].strip() == "the answer"
    body, parser = request(parsers)  # thinking off (the configured default): all content
    message, _ = chat_output.chat_message(parser, True, body, "plain", tok.encode("plain"))
    assert message == {"role": "assistant", "content": "plain"}


ENTRIES = (
    TokenLogprob(5, -0.5, "hé", ((5, -0.5, "hé"), (6, -1.5, "b"))),
    TokenLogprob(7, float("-inf"), "c", ((8, -0.1, "d"),)),
)


def test_chat_logprobs_shape():
    out = chat_output.chat_logprobs(ENTRIES)
    first, second = out["content"]
    assert first == {
        "token": "hé",
        "logprob": -0.5,
        "bytes": list("hé".encode()),
        "top_logprobs": [
            {"token": "hé", "logprob": -0.5, "bytes": list("hé".encode())},
            {"token": "b", "logprob": -1.5, "bytes": [98]},
        ],
    }
    assert second["logprob"] == -9999.0  # -inf is not JSON
    assert chat_output.chat_logprobs(None) is None


def test_completion_logprobs_legacy_shape():
    out = chat_output.completion_logprobs(ENTRIES, offset=10)
    assert out == {
        "tokens": ["hé", "c"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"hé": -0.5, "b": -1.5}, {"d": -0.1}],
        "text_offset": [10, 12],
    }


def test_engine_request_with_client_params_pickles_and_decode_gets_them():
    """The client's SamplingParams cross Ray inside `EngineRequest`; the engine uses a copy
    with the fitted max_tokens and the transfer params; the prefill leg's plain options
    carry no structured output and stay greedy."""
    import pickle

    from vllm.sampling_params import RequestOutputKind

    from app.engines.engine import sampling_params
    from app.engines.wire import EngineRequest, Sampling

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 2,
            "top_k": 5,
            "response_format": {"type": "json_object"},
        }
    )
    client = body.to_sampling_params(100, {})
    sampling = Sampling(max_tokens=100, params=client)
    fitted = Sampling(**{**sampling.__dict__, "max_tokens": 40})  # as Turns._fit does
    request = pickle.loads(
        pickle.dumps(EngineRequest("r", (1, 2, 3), fitted, kv_params={"do_remote_prefill": True}))
    )
    params = sampling_params(request)
    assert params.max_tokens == 40 and params.logprobs == 2 and params.top_k == 5
    assert params.structured_outputs.json_object and params.output_kind == RequestOutputKind.DELTA
    assert params.extra_args == {"kv_transfer_params": {"do_remote_prefill": True}}
    assert client.max_tokens == 100 and client.extra_args is None  # the original is untouched
    prefill = sampling_params(EngineRequest("r-prefill", (1, 2, 3), Sampling(max_tokens=1, temperature=0.0)))
    assert (
        prefill.max_tokens == 1
        and prefill.temperature == 0.0
        and prefill.structured_outputs is None
        and prefill.logprobs is None
    )


def test_grammar_the_engine_would_refuse_is_a_400_here():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}},
            },
        }
    )
    with pytest.raises(Exception) as err:
        openai_api.check_structured_output(body.to_sampling_params(8, {}))
    assert errors.error_body(err.value)[0] == 400
    ok = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}
    )
    openai_api.check_structured_output(ok.to_sampling_params(8, {}))
