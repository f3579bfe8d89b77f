"""The serving sections: sessions and the handle store, the ingress, tenants and access, the
OpenAI and Responses surfaces, and what a stopping decode replica does with its conversations."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from app.config.base import Strict


class SessionConfig(Strict):
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


class IngressConfig(Strict):
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


class TenantPolicy(Strict):
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


class AccessConfig(Strict):
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


class OpenAIConfig(Strict):
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


class ResponsesConfig(Strict):
    """The Responses API's stored responses (`previous_response_id`), kept in the handle
    store's shards beside the sessions they continue."""

    max_responses: int = Field(100_000, ge=1, description="Most stored responses (all shards together).")
    max_bytes: int = Field(256 << 20, ge=1 << 20, description="Most bytes of stored responses (all shards).")
    ttl_s: float = Field(
        86400.0,
        gt=0,
        description="A stored response unused for this long is forgotten (its chain then 404s).",
    )


class DrainConfig(Strict):
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
