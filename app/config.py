"""The app's one validated config tree.

Built once by the builder (`app.graph`) from `serve run` arguments, a YAML file, or a
Serve config's `args:`, validated before any deployment starts, then passed down through
constructors. Every field says what it does; bad values stop `serve run` with a message.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "default" / "tiny-qwen3"
"""`make run`'s model: the embedded tiny model whose answers end (`app.engines.default_model`)."""
OPEN_MODEL = REPO_ROOT / "models" / "tiny-qwen3"
"""The same weights with answers that run to `max_tokens`: the tests' and benchmarks'."""


class Mode(str, enum.Enum):
    BIDIR = "bidir"
    """P/D with KV reuse both ways: prefill pulls the history from decode each turn."""
    ONEWAY = "oneway"
    """Plain P/D: prefill recomputes the whole conversation every turn."""
    SINGLE = "single"
    """One engine per replica, prefix caching, session affinity, no transfer."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class AutoscalingRoleConfig(_Strict):
    """Serve autoscaling of one role on the app's own signals (`app.fleet.autoscaling`): decode on
    the share of its KV blocks in use (running and pinned), prefill on the new prompt
    tokens in flight. Serve applies the bounds and delays."""

    min_replicas: int = Field(1, ge=1, description="Fewest replicas.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_kv_in_use: float = Field(
        0.7,
        gt=0,
        le=1,
        description=(
            "Decode: the pool's share of KV blocks in use (running and pinned) to keep; above it a replica "
            "is added, and replicas go while the rest would stay under it."
        ),
    )
    target_queued_tokens: int = Field(
        8192,
        ge=1,
        description=(
            "Prefill: new prompt tokens in flight per replica to keep (about the TTFT target times one "
            "replica's prefill rate)."
        ),
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="How long a scale-up must be wanted before it happens."
    )
    downscale_delay_s: float = Field(
        60.0,
        ge=0,
        description="How long a scale-down must be wanted before it happens (then the replica drains).",
    )
    metrics_interval_s: float = Field(2.0, gt=0, description="How often replicas report their signal.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window the signal is averaged over.")

    @model_validator(mode="after")
    def _bounds_in_order(self) -> AutoscalingRoleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.min_replicas must not exceed max_replicas")
        return self


class EngineRoleConfig(_Strict):
    """Replicas and resources of one role (prefill or decode)."""

    num_replicas: int = Field(
        1,
        ge=1,
        description="Serve replicas of this role, one vLLM engine each (the first count when autoscaled).",
    )
    autoscaling: AutoscalingRoleConfig | None = Field(
        None, description="Scale this role on the app's signals between bounds (None: num_replicas, fixed)."
    )
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (set to tensor_parallel_size on GPU).")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {'decode_pool': 1} to pin a role to a node type.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism per engine.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests a replica takes at once; session affinity yields past this."
    )
    enable_prefix_caching: bool = Field(True, description="vLLM automatic prefix caching on this role.")
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="KV cache size per engine (CPU: host RAM). None: vLLM's sizing on GPU, 1 GiB on CPU.",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vllm AsyncEngineArgs for this role (e.g. max_num_batched_tokens).",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "CPU engines: OpenMP threads per engine. None: the node's cores times this replica's "
            "share of the node's CPU resource (num_cpus / node CPUs), at least 1 (app.engines.sizing)."
        ),
    )
    cpu_binding: Literal["nobind", "exclusive", "vllm"] = Field(
        "nobind",
        description=(
            "CPU engines: 'nobind' lets the threads float over the node's cores; 'exclusive' gives "
            "each engine its own cores (unbound if too few are free); 'vllm' is vLLM's own binding, "
            "which puts every engine of a node on the same cores."
        ),
    )
    cpu_spin_ms: float | None = Field(
        0.0,
        ge=0,
        description=(
            "CPU engines: how long the engine core and its worker process busy-wait for each "
            "other's next message before sleeping until notified (rechecking the queue as "
            "they wait). vLLM spins for 1 s, which "
            "keeps a core busy per process while the model computes on another; 0 sleeps at "
            "once (a wake-up costs microseconds per step). None: vLLM's own."
        ),
    )


class TransferConfig(_Strict):
    """How KV moves between engines (vLLM NixlConnector)."""

    backend: Literal["UCX", "LIBFABRIC"] = Field(
        "UCX",
        description="NIXL backend. UCX works everywhere (EFA via UCX's srd transport); LIBFABRIC for EFA.",
    )
    kv_buffer_device: Literal["cpu", "cuda"] | None = Field(
        None, description="Where NIXL reads KV from. None: 'cuda' on GPU machines, 'cpu' otherwise."
    )
    recompute_threshold_tokens: int = Field(
        64, ge=0, description="Prefill recomputes instead of pulling when fewer tokens would be pulled."
    )
    decoder_kv_blocks_ttl_s: float = Field(
        480.0, gt=0, description="How long a decode engine pins a finished turn's blocks for the next pull."
    )
    decode_local_tokens: int = Field(
        512,
        ge=0,
        description=(
            "bidir: a turn with at most this many tokens to compute (the prompt past the history its "
            "decode replica holds; a whole first prompt) skips the prefill leg: the session's decode "
            "replica computes them over its own prefix cache, as one engine would, and keeps the "
            "turn's blocks for the next pull; under `placement: priced` only while the answers "
            "streaming there stay within `itl_target_ms`. Longer turns go through prefill, which "
            "pulls the history. 0 (with `decode_local_busy_tokens` 0): every turn goes through prefill."
        ),
    )
    decode_local_busy_tokens: int = Field(
        2048,
        ge=0,
        description=(
            "bidir: a longer turn with at most this many tokens to compute goes to the session's "
            "decode replica instead when that gives its first token sooner, at the paces this ingress "
            "measured (`placement: priced`: prefill's queue, compute and hand-off against the "
            "replica's decode-local turns, compute and its streams' steps, and only while those "
            "streams stay within `itl_target_ms`; `static`: only while prefill legs are in flight, "
            "queue and compute only). 0: only `decode_local_tokens` applies."
        ),
    )
    placement: Literal["priced", "static"] = Field(
        "priced",
        description=(
            "bidir: how a turn's place is chosen (`app.turn.placement`). 'priced' weighs the turn's first "
            "token via decode and via prefill and what computing it on decode costs the answers "
            "streaming there; 'static' is the older rule, from the turn's own first token only."
        ),
    )
    itl_target_ms: float = Field(
        50.0,
        gt=0,
        description=(
            "The inter-token latency the answers streaming on a decode replica should keep (the "
            "fleet study's target, ITL p99 50 ms): `placement: priced` computes no turn on a decode "
            "replica whose streams' steps it would stretch past it."
        ),
    )
    decode_chunk_tokens: int = Field(
        256,
        ge=0,
        description=(
            "P/D modes: a decode engine computes at most this many tokens of a prompt per step "
            "(vLLM chunked prefill: `long_prefill_token_threshold`, and `max_num_batched_tokens` "
            "this plus `max_num_seqs`), so a turn computed there stretches its streams' steps by a "
            "bounded amount. Size it to what the decode engine computes within `itl_target_ms` less "
            "a step. 0: vLLM's own budget. A role's `engine_kwargs` override it."
        ),
    )
    idle_poll_ms: float = Field(
        20.0,
        ge=0,
        description=(
            "While an engine holds finished turns' blocks for transfer and has nothing to compute, "
            "it checks transfer completions this often instead of spinning every millisecond "
            "(new requests still wake it at once). 0: vLLM's own loop."
        ),
    )
    nixl_progress_poll_ms: float = Field(
        5.0,
        ge=0,
        description=(
            "Poll timeout of NIXL's UCX progress thread in each engine. It wakes on UCX events "
            "anyway; NIXL's Python agent sets 0, which busy-polls a full core per engine. "
            "0: NIXL's own setting."
        ),
    )
    prefill_timeout_s: float = Field(
        120.0,
        gt=0,
        description=(
            "What a prefill leg without history may wait for a replica (e.g. all restarting), "
            "on top of twice its expected compute; past that decode computes the prompt itself."
        ),
    )
    pull_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "What a pull may add to a prefill leg. A leg that pulls history gets this plus twice "
            "the compute expected for its new tokens and those of legs ahead of it (measured "
            "on recent legs); past that it is aborted and recomputed without the pull (a failed "
            "NIXL handshake can otherwise stall it)."
        ),
    )
    side_channel_base_port: int = Field(
        5600,
        ge=1024,
        le=65000,
        description="First NIXL side-channel port tried on each node; each replica takes a free one.",
    )
    pin_margin_s: float = Field(
        6.0,
        ge=0,
        description=(
            "A pull of history must be expected to end this long before the decode engine's pin "
            "of it does (vLLM's prefill declines reads within 5 s of it). A pull that cannot is "
            "not started (recompute), and a leg still waiting at that point is aborted and "
            "recomputed (counted as pull_deadline)."
        ),
    )
    host_offload_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description=(
            "GPU engines: host DRAM per engine for vLLM's OffloadingConnector beside NIXL (a "
            "MultiConnector): blocks leaving the accelerator stay in the engine's prefix cache in "
            "host memory, so a turn after a long pause or an early release reloads them locally. "
            "None: off. Not supported on CPU engines (their KV already is host memory)."
        ),
    )


class SessionConfig(_Strict):
    """Sessions, KV handles and routing."""

    session_header: str = Field("x-session-id", description="HTTP header naming a turn's session.")
    match_sessionless: bool = Field(
        True, description="Find the session of a request without header by matching its prompt tokens."
    )
    token_in_token_out: bool = Field(
        True,
        description=(
            "Re-use the exact token ids generated for an answer when the client re-sends its text, "
            "instead of re-tokenizing it (which can give other ids and cut reuse short)."
        ),
    )
    handle_ttl_s: float = Field(
        420.0,
        gt=0,
        description="How long a stored KV handle may be used; must be below decoder_kv_blocks_ttl_s.",
    )
    max_sessions: int = Field(
        10_000, ge=1, description="Conversations kept (LRU); older ones lose their handle."
    )
    max_store_bytes: int = Field(
        4 << 30,
        ge=1 << 20,
        description=(
            "Memory the store may use for conversations (token ids and prefix index), split evenly "
            "among the shards; past it the least recently used conversations are dropped."
        ),
    )
    max_pinned_blocks_per_engine: int = Field(
        1_000_000,
        ge=1,
        description=(
            "Blocks the store lets one decode engine keep pinned for waiting sessions, until the "
            "engine's real block count is known (then pinned_fraction of it)."
        ),
    )
    pinned_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "Share of a decode engine's KV blocks that waiting conversations may keep pinned; "
            "past it the least recently used handle is evicted and its blocks freed at once, "
            "so running requests always have room."
        ),
    )
    release_interval_s: float = Field(
        2.0,
        gt=0,
        description=(
            "How often an ingress replica collects the handles the store let go unread (expired "
            "while no turn came) and asks their decode engines to free the blocks now. Turns "
            "and session deletes release at once."
        ),
    )
    store_shards: int = Field(
        1,
        ge=1,
        description=(
            "Ray actors holding handles, sharded by session. One shard served 500-1,400 turns/s "
            "on a 2-core machine (`python -m bench.store`); add shards for larger fleets."
        ),
    )
    store_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray resources of the SessionStore replica (placement, e.g. {'head': 0.01}); "
        "its shards run beside it.",
    )
    prefill_routing: Literal["least_loaded", "sticky"] = Field(
        "least_loaded",
        description="Prefill replica choice: least loaded, or the one that served the session last.",
    )


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="Ingress (HTTP/handle) replicas.")
    num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves per ingress replica.")
    max_ongoing_requests: int = Field(256, ge=1)
    max_continuations: int = Field(
        2,
        ge=0,
        le=16,
        description=(
            "Times one streamed answer goes on on another decode replica after the replica streaming "
            "it failed (the survivor computes the prompt plus the tokens already sent); past it the "
            "stream ends with an error event. 0: a failure after the first token always ends the stream."
        ),
    )


class TenantPolicy(_Strict):
    """What one tenant (an API key) may hold and send (`app.api.quotas`, `connector.shares`)."""

    weight: float = Field(
        1.0,
        gt=0,
        description=(
            "Share of each decode engine's pinned-KV budget, relative to other tenants' weights. "
            "Idle share is lent; a tenant over its share loses its own oldest conversations first."
        ),
    )
    max_sessions: int | None = Field(
        None,
        ge=1,
        description=(
            "Live sessions (a turn within sessions.handle_ttl_s); a turn that would start one more "
            "is refused with 429 and Retry-After."
        ),
    )
    max_concurrent_turns: int | None = Field(
        None, ge=1, description="Turns in flight at once; more are refused with 429 and Retry-After."
    )
    prompt_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens accepted per rolling minute; more are refused with 429 and Retry-After.",
    )


class AccessConfig(_Strict):
    """Who may call the API, what tenants share, and what it shows (`app.api.auth`)."""

    api_keys: tuple[str, ...] = Field(
        (),
        description=(
            "API keys (as vLLM's --api-key). When set, every HTTP route but /health needs "
            "'Authorization: Bearer <key>', and each key's sessions live in a namespace of their own."
        ),
    )
    expose_kv_stats: bool = Field(
        True, description="Serve GET /v1/kv/stats (reuse counters and the store's state)."
    )
    tenants: dict[str, TenantPolicy] = Field(
        default_factory=dict,
        description="Per API key: its weight and quotas (keys not listed get default_tenant).",
    )
    default_tenant: TenantPolicy = Field(
        default_factory=TenantPolicy,
        description="Weight and quotas of keys not in `tenants`, and of trusted handle callers.",
    )
    share_prefix_cache: bool = Field(
        False,
        description=(
            "Let tenants hit each other's cached prefixes (e.g. a common system prompt). Off: every "
            "engine request carries its tenant's cache salt, so no tenant can tell from cached_tokens "
            "or timing what another sent. On, that side channel is open."
        ),
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        if isinstance(value, str):  # `access.api_keys=k1,k2` from `serve run`
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @field_validator("api_keys")
    @classmethod
    def _non_empty_keys(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not k or k != k.strip() for k in value):
            raise ValueError("api keys must be non-empty and carry no surrounding spaces")
        return value

    @model_validator(mode="after")
    def _tenants_are_keys(self) -> AccessConfig:
        unknown = [k for k in self.tenants if k not in self.api_keys]
        if unknown:
            raise ValueError(f"access.tenants names {len(unknown)} key(s) that are not in access.api_keys")
        return self


class OpenAIConfig(_Strict):
    """The OpenAI surface: output parsers (vLLM's own) and request limits (`app.api.openai_api`)."""

    tool_call_parser: str | None = Field(
        "auto",
        description=(
            "vLLM tool parser for tool_choice 'auto' (e.g. 'hermes'). 'auto': by model family "
            "(Qwen, Hermes, tiny-qwen3: hermes); None: 'auto' tool choice answers in plain content."
        ),
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM reasoning parser (e.g. 'qwen3'): thinking goes to message.reasoning_content."
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "parameter",
        description=(
            "vLLM's --tool-strict-level: 'parameter' makes named/required tool choice decode arguments valid "
            "against each tool's JSON schema; 'auto' only for tools marked strict."
        ),
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Defaults under each request's chat_template_kwargs (as vLLM's --default-chat-template-kwargs), "
            "e.g. {'enable_thinking': false}; the reasoning parser reads them too."
        ),
    )
    max_request_bytes: int = Field(4 << 20, ge=1024, description="Largest request body; larger ones get 413.")
    max_messages: int = Field(4096, ge=1, description="Most messages in one chat request.")
    max_session_id_chars: int = Field(256, ge=8, description="Longest session id header value.")
    max_logprobs: int = Field(
        20, ge=0, le=20, description="Largest top_logprobs (completions: logprobs) accepted."
    )
    compact_json: bool = Field(
        True,
        description=(
            "Constrained JSON (tool arguments under required/named tool choice, response_format, Responses "
            "text.format, Anthropic forced tools) without whitespace outside strings: the grammars otherwise "
            "let a model pad JSON until max_tokens. False: vLLM's grammars as they are."
        ),
    )
    strip_system_patterns: list[str] = Field(
        default_factory=lambda: [r"^x-anthropic-billing-header:.*(?:\n|$)"],
        description=(
            "Regular expressions (multiline) removed from system and developer text on every API before "
            "rendering: per-request nonces some agent CLIs put in the system prompt would change its first "
            "tokens on every request and defeat all reuse. Default: Claude Code's billing header line."
        ),
    )

    @field_validator("strip_system_patterns")
    @classmethod
    def _patterns_compile(cls, value: list[str]) -> list[str]:
        for pattern in value:
            try:
                re.compile(pattern, re.MULTILINE)
            except re.error as exc:
                raise ValueError(
                    f"strip_system_patterns: {pattern!r} is not a regular expression: {exc}"
                ) from None
        return value


class ResponsesConfig(_Strict):
    """The Responses API's stored responses (`previous_response_id`), kept in the handle
    store's shards beside the sessions they continue."""

    max_responses: int = Field(100_000, ge=1, description="Most stored responses (all shards together).")
    max_bytes: int = Field(256 << 20, ge=1 << 20, description="Most bytes of stored responses (all shards).")
    ttl_s: float = Field(
        86400.0,
        gt=0,
        description="A stored response unused for this long is forgotten (its chain then 404s).",
    )


class DrainConfig(_Strict):
    """What a stopping decode replica (a downscale, a redeploy, a node drain) does with the
    conversations it pins, after its in-flight answers finished (Serve's graceful shutdown)."""

    migrate: bool = Field(
        True,
        description=(
            "Move the replica's pinned conversations to the surviving decode replicas over NIXL (most "
            "recently used first) instead of dropping them: their next turn reuses the history there."
        ),
    )
    budget_s: float = Field(
        30.0,
        ge=0,
        description=(
            "Seconds the moves may take; conversations not moved by then are dropped (counted). Added to "
            "the decode replicas' graceful shutdown time."
        ),
    )
    parallel: int = Field(4, ge=1, le=64, description="Conversations moved at once.")
    answer_grace_s: float = Field(
        30.0,
        ge=0,
        description="Seconds a stopping engine replica (either role) lets its in-flight requests finish.",
    )
    rebalance: bool = Field(
        True,
        description=(
            "Move the least recently used conversations of a decode replica whose pinned share is nearly "
            "full to the peer with the most room, instead of evicting them once it is full."
        ),
    )
    rebalance_above: float = Field(
        0.9, gt=0, le=1, description="Share of its pinned budget past which a replica rebalances."
    )
    rebalance_below: float = Field(
        0.6, gt=0, le=1, description="Share of its pinned budget under which a peer takes conversations."
    )
    wait_s: float = Field(
        2.0,
        ge=0,
        description=(
            "How long a turn whose conversation is being moved waits for the move to end before it "
            "recomputes the history instead."
        ),
    )

    @model_validator(mode="after")
    def _marks_in_order(self) -> DrainConfig:
        if self.rebalance_below >= self.rebalance_above:
            raise ValueError("drain.rebalance_below must be below drain.rebalance_above")
        return self


class AppConfig(_Strict):
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
    def disaggregated(self) -> bool:
        return self.mode is not Mode.SINGLE

    @classmethod
    def from_args(cls, args: Mapping[str, Any] | None) -> AppConfig:
        """Build from `serve run app:graph key=value ...` arguments or a Serve config's `args`.

        Keys may be dotted (`prefill.num_replicas=2`); `config=path.yaml` loads a file first,
        other keys override it. `serve run` passes every value as a string: pydantic
        converts them, and JSON-looking values (`{...}`, `[...]`) are parsed.
        """
        args = dict(args or {})
        tree: dict[str, Any] = {}
        config_file = args.pop("config", None)
        if config_file:
            loaded = yaml.safe_load(Path(config_file).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{config_file}: expected a mapping at the top level")
            tree.update(loaded)
        for key, value in args.items():
            if isinstance(value, str) and value[:1] in "{[":
                value = yaml.safe_load(value)
            node = tree
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(f"argument {key!r} nests under a non-mapping value")
            node[leaf] = value
        return cls.model_validate(tree)
