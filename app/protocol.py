"""OpenAI-compatible request bodies, validated, and the API's error type.

Requests allow unknown fields (clients send many we ignore) but never the engines'
transfer machinery: `kv_transfer_params` from a client is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FORBIDDEN_FIELDS = ("kv_transfer_params",)


class APIError(Exception):
    """An error the client caused or must see, as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    user: str | None = None
    return_token_ids: bool = Field(False, description="vLLM extension: include prompt and answer token ids.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_transfer_params(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in FORBIDDEN_FIELDS:
                if name in data:
                    raise ValueError(f"'{name}' is reserved for the server and cannot be set by clients")
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"content part type {part.get('type')!r} is not supported")
                parts.append(str(part.get("text", "")))
            message["content"] = "".join(parts)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None

    @property
    def answer_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt must not be empty")
            if isinstance(p[0], (str, list)):
                if len(p) != 1:
                    raise ValueError("one prompt per request is supported")
        elif not p:
            raise ValueError("prompt must not be empty")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    @property
    def answer_limit(self) -> int | None:
        return self.max_tokens

    def prompt_text_or_ids(self) -> tuple[str | None, tuple[int, ...] | None]:
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p, None
        return None, tuple(int(t) for t in p)
