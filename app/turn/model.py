"""What a turn takes and gives, and the seams it reaches the rest through.

`TurnInput` (built by the ingress from a request), the events `Turns.run` yields (`Delta`,
then one `TurnResult`), and the protocols of what the pipeline calls: `Tokenizer`,
`EngineClients` (the engine replicas; `app.fleet.clients.ServeEngineClients` in production) and
`Store` (the handle store; `connector.client.StoreClient`). Unit tests run the real
pipeline against fakes of these. No vLLM, no Ray.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from app.engines.wire import EngineChunk, EngineRequest, Sampling
from app.fleet.memory import DecodeMemoryClients
from connector.store_api import TurnStore


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def piece(self, token_id: int) -> str:
        """The text of one special token, as a chat template writes it."""
        ...


class EngineClients(DecodeMemoryClients, Protocol):
    """How the orchestration reaches engine replicas (Serve handles in production), the
    decode-memory calls of `app.fleet.memory` included."""

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]: ...

    def decode(self, request: EngineRequest) -> AsyncIterator[tuple[EngineChunk, str]]: ...

    def decode_alive(self, replica_id: str) -> bool | None: ...

    async def decode_stopping(self, replica_id: str) -> bool:
        """Whether a decode replica that is no longer running still lives (Serve drains it)."""
        ...

    def hosts_on_prefill(self, replica_id: str | None) -> bool:
        """Whether `replica_id` is a running prefill replica (`transfer.prefill_hosts`:
        `decode` calls that prefer it are answered there)."""
        ...

    def prefill_replicas(self) -> frozenset[str] | None:
        """Running prefill replicas as the router last saw them (None: not known)."""
        ...


class Store(TurnStore, Protocol):
    """The handle store as a turn calls it (`connector.store_api.TurnStore`, which
    `connector.client.StoreClient` implements), the decode-memory hooks of
    `app.fleet.memory` included."""


@dataclass(frozen=True)
class TurnInput:
    request_id: str
    sampling: Sampling
    session_id: str | None = None
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    max_tokens_given: bool = True
    namespace: str = ""
    """Tenant prefix of session ids (`app.api.auth`): `session_id` already carries it; new
    sessions get it and sessionless matches stay inside it. Results show ids without it."""
    cache_salt: str | None = None
    """The tenant's prefix-cache salt (`app.api.auth.Tenant.salt_for`), on every engine request
    of the turn: cached prefixes only ever hit within one tenant."""
    stream: bool = True
    """The client sees the answer as it is generated. A turn that does not stream gets
    its deltas at the end, so a decode replica that fails midway costs a recompute on
    another replica, not an error."""
    retain: bool = False
    """The client asked for long retention (Anthropic `cache_control` ttl "1h"): the
    store evicts this conversation's pinned KV after ones that did not ask."""
    session_keyed: bool = False
    """`session_id` is the agent's own key (`prompt_cache_key`, Claude Code's session id),
    not an `x-session-id` header: a turn whose prompt does not extend that conversation
    (a sub-agent or a fork under the same key) is matched by its prompt instead, so it
    never takes the keyed conversation's place."""


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple | None = None
    """The engine's `TokenLogprob`s of these tokens, when the request asked for them."""
    cached_tokens: int | None = None
    """On an answer's first delta: prompt tokens not computed for this turn, as known at
    its first token (Anthropic's `message_start` reports them)."""


@dataclass(frozen=True)
class TurnResult:
    """The end of a turn: what the client is told, and the reuse facts behind it."""

    session_id: str
    finish_reason: str
    prompt_token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reused_from_decode: int
    """Positions of the history offered to prefill from the decode engine (after capping)."""
    miss_reason: str | None
    spliced: bool
    decode_replica: str | None
    timings: dict[str, float] | None = None
    """Where the time to first token went. Milestones, in seconds from the turn's start:
    `store_s` (session resolved: the store's round trip), `session_s` (handle verified
    against the prompt), `prefill_s` (prefill leg back at the ingress, P/D only),
    `first_token_s` (first output from decode). The engines' own spans, from vLLM's
    request stats: `prefill_engine_s` / `decode_engine_s` (arrival at the engine to its
    first token; decode's includes reading the KV it lacks) and their `*_queue_s` parts.
    What `first_token_s` has beyond `session_s` and the two engine spans is transport
    (Serve calls, scheduling, serialization)."""
    placement: str | None = None
    """Why the turn was computed where it was (`app.turn.placement.Reason`: `short`,
    `sooner`, `itl`, ...); None where no choice was made (a mode without P/D reuse)."""

    def __post_init__(self) -> None:
        # A plain string, not the app's `MissReason`: results travel (stored responses go
        # to the store's shards, which must not import this package, and vLLM with it, to
        # read them).
        if self.miss_reason is not None:
            object.__setattr__(self, "miss_reason", str(self.miss_reason))


TurnEvent = Delta | TurnResult
