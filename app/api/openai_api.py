"""The OpenAI surface around a turn: request bodies in, response bodies out.

* `read_body`: an HTTP body within the size limit (413 past it, from Content-Length
  before reading), parsed as JSON that the rest of the stack can hold (400 for invalid
  JSON, lone surrogates, nesting past `MAX_DEPTH`, integers Python refuses to parse).
* `OutputParsers`: vLLM's own tool-call and reasoning parsers (`vllm.parser`), picked
  by config with a per-family default, one instance per request.
* Requests for the engine: system text without per-request nonces, compact tool-call
  arguments and grammars, the model's sampling defaults. Answers' OpenAI objects
  (`message` / `delta` / `logprobs`) are `app.api.chat_output`'s and `app.api.shaping`'s.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

from app.api.protocol import ChatCompletionRequest
from app.config import AppConfig
from app.errors import APIError, client_error

logger = logging.getLogger("ray.serve").getChild(__name__)

MAX_DEPTH = 64
"""Deepest JSON nesting a request may have (OpenAI bodies need a handful of levels;
tool schemas a few more)."""

TEMPLATE_KWARGS_RESERVED = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

# -- requests ------------------------------------------------------------------------------


async def read_body(request, limit: int) -> dict[str, Any]:
    """The JSON object of an HTTP request, or APIError (413 / 400)."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            too_big = int(length) > limit
        except ValueError:
            raise APIError(400, "invalid Content-Length header") from None
        if too_big:
            raise APIError(413, f"the request body is larger than {limit} bytes", type="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", type="request_too_large")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, oversized integers
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_values(data)
    return data


def check_json_values(data: Any) -> None:
    """Refuse what JSON allows but the stack can't hold: lone UTF-16 surrogates (they
    can't be encoded, e.g. by the tokenizer) and nesting deeper than `MAX_DEPTH`."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body contains a lone UTF-16 surrogate (invalid Unicode)") from None


def template_kwargs(cfg: AppConfig, body: ChatCompletionRequest) -> dict[str, Any]:
    """Chat template keyword arguments: the configured defaults under the request's
    `chat_template_kwargs` (as vLLM's --default-chat-template-kwargs), minus the names
    the renderer itself sets."""
    given = body.chat_template_kwargs or {}
    bad = sorted(set(given) & TEMPLATE_KWARGS_RESERVED)
    if bad:
        raise APIError(
            400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs"
        )
    return {**cfg.openai.chat_template_kwargs, **given}


def strip_system(messages: list[dict[str, Any]], patterns: list[re.Pattern]) -> list[dict[str, Any]]:
    """System and developer text without what `patterns` match (per-request nonces some
    agent CLIs write there, which would change the prompt's first tokens every turn).
    A message left empty is dropped."""
    if not patterns:
        return messages
    out = []
    for message in messages:
        if message["role"] in ("system", "developer") and isinstance(message.get("content"), str):
            text = message["content"]
            for pattern in patterns:
                text = pattern.sub("", text)
            if not text.strip():
                continue
            message = {**message, "content": text}
        out.append(message)
    return out


def compact_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments in the history written compactly, as the engine generated them
    under compact grammars (`compact_json`). Parsers hand clients the arguments re-dumped
    with spaces; sent back as they are, they would re-render differently from the tokens
    of the turn that made them, and reuse would stop there."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_compact_call(c) for c in calls]}
        out.append(message)
    return out


def _compact_call(call: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(call["function"]["arguments"])
    except ValueError:
        return call  # not JSON: rendered as sent
    arguments = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": arguments}}


def check_structured_output(params) -> None:
    """Compile the request's grammar here (vLLM's xgrammar check) so a schema the decode
    engine would refuse answers 400 before anything runs."""
    if params.structured_outputs is None:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(params.clone())
    except VLLMValidationError:
        raise
    except (ValueError, TypeError) as exc:
        raise client_error(exc) from exc


def compact_structural_tag(params) -> None:
    """Make the JSON inside a structural tag (the tool parsers' grammar for tool calls)
    compact: each JSON-schema region becomes xgrammar's grammar of that schema without
    whitespace outside strings, and a tag's whitespace-only variants its first form. The
    engine's `disable_any_whitespace` covers plain JSON schemas but not these regions,
    which otherwise let a model pad arguments until max_tokens."""
    outputs = params.structured_outputs
    if outputs is None or not outputs.structural_tag:
        return
    tag = json.loads(outputs.structural_tag)
    outputs.structural_tag = json.dumps(_compact_regions(tag))


def _compact_regions(node: Any) -> Any:
    if isinstance(node, list):
        return [_compact_regions(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        schema = node.get("json_schema")
        return {"type": "grammar", "grammar": _compact_grammar(json.dumps(schema, sort_keys=True))}
    out = {key: _compact_regions(value) for key, value in node.items()}
    if isinstance(out.get("tags"), list):
        out["tags"] = _first_of_each_form(out["tags"])
    return out


def _first_of_each_form(tags: list) -> list:
    """Tags that differ only in whitespace (hermes: `<tool_call>\n{...}\n</tool_call>` and
    `<tool_call>{...}</tool_call>`) reduced to the first, the form the chat template
    renders: a call the model writes in another form would not re-render as generated."""
    seen, out = set(), []
    for tag in tags:
        if isinstance(tag, dict) and isinstance(tag.get("begin"), str) and isinstance(tag.get("end"), str):
            bare = lambda text: re.sub(r"\s", "", text)  # noqa: E731
            form = (bare(tag["begin"]), bare(tag["end"]), json.dumps(tag.get("content")))
            if form in seen:
                continue
            seen.add(form)
        out.append(tag)
    return out


@functools.lru_cache(maxsize=256)
def _compact_grammar(schema: str) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":")))


# -- output parsers ------------------------------------------------------------------------


GENERATION_DEFAULTS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)
"""Sampling fields a model's `generation_config.json` may set for requests that leave them
unset: the list vLLM's OpenAI server reads (`ModelConfig.get_diff_sampling_param`)."""


def sampling_defaults(cfg: AppConfig) -> dict[str, Any]:
    """The model's own sampling defaults (its `generation_config.json`), as vLLM's OpenAI
    server applies them with `--generation-config auto`: a request's fields win; and
    Hugging Face's `min_new_tokens` as `min_tokens`. Called once per ingress replica; a
    model without the file has none."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(cfg.model).to_dict()
    except (OSError, ValueError):
        return {}
    defaults = {name: config[name] for name in GENERATION_DEFAULTS if config.get(name) is not None}
    if config.get("min_new_tokens"):
        defaults["min_tokens"] = config["min_new_tokens"]
    return defaults


def apply_min_tokens(params, body, defaults: dict[str, Any]) -> None:
    """The model's `min_tokens` default on a request that set none (vLLM's request models
    default it to 0 without reading the model's defaults), within the answer's limit."""
    floor = defaults.get("min_tokens")
    if floor and "min_tokens" not in body.model_fields_set and not params.min_tokens:
        params.min_tokens = min(floor, params.max_tokens or floor)


def default_tool_parser(cfg: AppConfig) -> str | None:
    """The tool parser for `tool_call_parser: auto`: hermes-style `<tool_call>` JSON for
    the Qwen and Hermes families (the embedded model included), none otherwise."""
    name = f"{cfg.model} {cfg.model_name}".lower()
    if any(family in name for family in ("qwen", "hermes")):
        return "hermes"
    return None


class OutputParsers:
    """vLLM's tool and reasoning parsers for this app, composed by vLLM's ParserManager."""

    def __init__(self, cfg: AppConfig, tokenizer):
        from vllm.parser import ParserManager

        tool = cfg.openai.tool_call_parser
        self.tool_parser = default_tool_parser(cfg) if tool == "auto" else tool
        self.reasoning_parser = cfg.openai.reasoning_parser
        self._tokenizer = tokenizer
        self._cls = ParserManager.get_parser(
            tool_parser_name=self.tool_parser,
            reasoning_parser_name=self.reasoning_parser,
            enable_auto_tools=self.tool_parser is not None,
            model_name=cfg.model,
            tool_strict_level=cfg.openai.tool_strict_level,
            tokenizer=tokenizer,
        )

    @property
    def auto_tools(self) -> bool:
        return self.tool_parser is not None

    def for_request(self, body: ChatCompletionRequest, kwargs: dict[str, Any]):
        """A parser for one chat request (None: plain content), after letting it adjust
        the request as vLLM's server does (named/required tool choice -> a JSON schema
        for guided decoding; tool markup kept in the text)."""
        needs_tools = bool(body.tools) and body.tool_choice not in (None, "none")
        if needs_tools and self._cls is None:
            if body.tool_choice == "auto":
                return None  # no parser: answers come back as content
            raise APIError(
                400,
                "tool_choice other than 'auto'/'none' needs a tool parser (openai.tool_call_parser)",
                param="tool_choice",
            )
        if self._cls is None:
            return None
        parser = self._cls(self._tokenizer, body.tools, chat_template_kwargs=kwargs)
        if needs_tools or self.reasoning_parser:
            parser.adjust_request(body)
        return parser
