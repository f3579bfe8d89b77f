"""`AppConfig`: the whole tree, the checks across its sections, and `from_args`, the one way
the builder and the tests build it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from app.config.base import DEFAULT_MODEL, Mode, Strict
from app.config.engines import EngineRoleConfig, TransferConfig
from app.config.loading import args_tree
from app.config.service import (
    AccessConfig,
    DrainConfig,
    IngressConfig,
    OpenAIConfig,
    ResponsesConfig,
    SessionConfig,
)


class AppConfig(Strict):
    """Everything the app needs, validated before anything starts."""

    mode: Mode = Field(Mode.BIDIR, description="bidir (this project), oneway (plain P/D) or single (no P/D).")
    model: str = Field(
        str(DEFAULT_MODEL),
        description="Hugging Face model id or local path. Default: the embedded tiny model.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in `model`. Default: the model's name."
    )
    tokenizer: str | None = Field(None, description="Tokenizer id or path. Default: the model's.")
    dtype: str = Field("auto", description="vLLM dtype, e.g. bfloat16.")
    load_format: str = Field(
        "auto", description="vLLM load format; 'dummy' for random weights from a config."
    )
    max_model_len: int = Field(
        65536,
        ge=16,
        description="Longest prompt + answer, in tokens (agent CLIs' first requests are tens of thousands).",
    )
    block_size: int = Field(32, ge=1, description="KV block size; equal on prefill and decode.")
    enforce_eager: bool = Field(False, description="Skip graph compilation (faster start, slower steps).")
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        description=(
            "Answer limit when a request sets none. Default: all the context leaves after the "
            "prompt, as vLLM's OpenAI server does (agents such as Codex send no limit)."
        ),
    )
    prefill: EngineRoleConfig = Field(default_factory=EngineRoleConfig)
    decode: EngineRoleConfig = Field(default_factory=EngineRoleConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    sessions: SessionConfig = Field(default_factory=SessionConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    access: AccessConfig = Field(default_factory=AccessConfig)
    openai: OpenAIConfig = Field(default_factory=OpenAIConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    app_name: str = Field("default", description="Serve application name the graph is deployed under.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for engine replicas (e.g. UCX_NET_DEVICES, FI_PROVIDER).",
    )

    @field_validator("model")
    @classmethod
    def _local_model_exists(cls, value: str) -> str:
        looks_local = value.startswith(("/", "./", "../", "~")) or value.startswith("models/")
        path = Path(value).expanduser()
        if looks_local and not path.exists():
            hint = " (run `make model` to build the embedded default)" if path == DEFAULT_MODEL else ""
            raise ValueError(f"model path {value!r} does not exist{hint}")
        return str(path) if looks_local else value

    @model_validator(mode="after")
    def _cross_checks(self) -> AppConfig:
        if self.sessions.handle_ttl_s >= self.transfer.decoder_kv_blocks_ttl_s:
            raise ValueError(
                "sessions.handle_ttl_s must be shorter than transfer.decoder_kv_blocks_ttl_s "
                f"({self.sessions.handle_ttl_s} >= {self.transfer.decoder_kv_blocks_ttl_s}): "
                "a handle must never outlive the blocks it points to"
            )
        if (
            self.prefill.tensor_parallel_size != self.decode.tensor_parallel_size
            and self.mode is not Mode.SINGLE
        ):
            # NixlConnector maps TP ranks for homogeneous layouts only in our tested set-up.
            raise ValueError("prefill and decode must use the same tensor_parallel_size")
        if self.default_max_tokens is not None and self.default_max_tokens >= self.max_model_len:
            raise ValueError("default_max_tokens must be below max_model_len")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def reuses_kv(self) -> bool:
        return self.mode is Mode.BIDIR

    @property
    def prefill_hosts(self) -> bool:
        """Prefill replicas may host sessions (`transfer.prefill_hosts`, in bidir with
        prefix caching on prefill: a hosted session's turns compute over that cache)."""
        return self.transfer.prefill_hosts and self.mode is Mode.BIDIR and self.prefill.enable_prefix_caching

    @property
    def disaggregated(self) -> bool:
        return self.mode is not Mode.SINGLE

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Build from `serve run app:graph key=value ...` arguments or a Serve config's `args`.

        Keys may be dotted (`prefill.num_replicas=2`); `config=path.yaml` loads a file first,
        other keys override it. `serve run` passes every value as a string: pydantic
        converts them, and JSON-looking values (`{...}`, `[...]`) are parsed.
        """
        return cls.model_validate(args_tree(args))
