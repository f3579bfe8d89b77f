"""What a store is built with (`StoreSettings`), and the one way to build its parts.

The app makes its settings from its config (`app.fleet.clients.store_settings`): the
builder binds the `SessionStore` deployment with them, each ingress checks the running
store has exactly these, and each shard builds its parts from them (`shard`). Tests and
benchmarks build stores the same way (`handle_store`, `shard`), overriding only what the
settings do not carry (a fake clock, a lease timeout). Pure Python, no Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from connector.records import DEFAULT_MAX_STORE_BYTES
from connector.response_store import ResponseStore
from connector.store import HandleStore


@dataclass(frozen=True)
class StoreSettings:
    """What a store is built with; the ingress checks the running store has exactly these."""

    handle_ttl_s: float
    decoder_ttl_s: float
    max_sessions: int
    max_blocks_per_engine: int
    index_block_size: int
    pinned_fraction: float = 0.5
    shards: int = 1
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """(tenant namespace, weight) of tenants whose share of pinned KV is not 1."""
    tenant_max_sessions: tuple[tuple[str, int], ...] = ()
    """(tenant namespace, conversations kept for it across all shards)."""
    max_responses: int = 100_000
    """Stored Responses API objects kept across all shards."""
    max_response_bytes: int = 256 << 20
    response_ttl_s: float = 86400.0
    """A stored response unused this long is forgotten."""

    def store_kwargs(self) -> dict[str, Any]:
        """One shard's `HandleStore` arguments: the byte bound and the tenants' session
        limits are split among the shards (sessions hash evenly over them)."""
        kwargs = dataclasses.asdict(self)
        for name in ("shards", "max_responses", "max_response_bytes", "response_ttl_s"):
            kwargs.pop(name)
        kwargs["max_store_bytes"] = max(1, self.max_store_bytes // self.shards)
        kwargs["tenant_weights"] = dict(self.tenant_weights)
        kwargs["tenant_max_sessions"] = {t: max(1, -(-n // self.shards)) for t, n in self.tenant_max_sessions}
        return kwargs

    def response_kwargs(self) -> dict[str, Any]:
        """One shard's `ResponseStore` arguments: count and bytes split among the shards."""
        return {
            "max_responses": max(1, self.max_responses // self.shards),
            "max_bytes": max(1, self.max_response_bytes // self.shards),
            "ttl_s": self.response_ttl_s,
        }

    def handle_store(self, **overrides: Any) -> HandleStore:
        """One shard's `HandleStore`. `overrides`: its arguments the settings do not carry
        (`clock`, `lease_timeout_s`, `text_block_chars`, `match_fanout`), or replace."""
        return HandleStore(**{**self.store_kwargs(), **overrides})

    def response_store(self, **overrides: Any) -> ResponseStore:
        """One shard's `ResponseStore` (`overrides` as in `handle_store`)."""
        return ResponseStore(**{**self.response_kwargs(), **overrides})
