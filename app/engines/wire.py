"""The engines' wire: what the ingress and the engine servers send each other.

Plain dataclasses that cross Ray (pickled), and `Engine`, the seam between an engine
server and its inference engine (`app.engines.engine.VLLMEngine` in production, a faithful fake
in unit tests). No vLLM import: the turn pipeline (`app.turn.turns`) and the ingress build and
read these without loading vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    """The sampling options we pass through to the engines."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    params: Any = None
    """The full vLLM `SamplingParams` of the client's request (vLLM's own
    `to_sampling_params`: penalties, logit_bias, top_k, min_p, logprobs, structured
    outputs, ...), or None for the plain options above. It pickles (it crosses Ray).
    The engine uses a copy with `max_tokens` and the transfer params set from here.
    Decode gets it; the prefill leg never does (one greedy token, no structured output)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the top alternatives at its position, by rank."""

    token_id: int
    logprob: float
    token: str
    top: tuple[tuple[int, float, str], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """One request to one engine. `kv_params` is wire form built by `connector.handle`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    kv_params: dict[str, Any] | None = None
    preferred_replica: str | None = None
    """Replica the session last used; read by the request router, not by the engine."""
    avoid_replicas: tuple[str, ...] = ()
    """Replicas that failed this turn: the router sends it elsewhere while it can."""
    cache_salt: str | None = None
    """vLLM's prefix-cache salt: blocks cached under one salt are only hit by requests
    with the same salt (one per tenant, `app.api.auth`)."""


@dataclass(frozen=True)
class ReplicaQuery:
    """Argument of calls aimed at one replica (e.g. `stats`): the request router sends
    it to `preferred_replica` while that replica lives."""

    preferred_replica: str | None = None


@dataclass(frozen=True)
class EngineChunk:
    """A delta of an engine's output. The last chunk has `finished` and the totals."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_params: dict[str, Any] | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One entry per token in `token_ids` when the request asked for logprobs."""
    engine_timings: dict[str, float] | None = None
    """On the first chunk with a token: the engine's own view of the request, from vLLM's
    request stats. `queue_s`: waiting to be scheduled; `first_token_s`: arrival at the
    engine to its first token (for decode in P/D this includes reading the KV it lacks)."""


PROMPT_STEP_TOKENS = 16
"""A step that computed at most this many prompt tokens counts as a decode step: a turn
whose KV was read from another engine computes its last token or few."""


@dataclass
class PromptTokenCounts:
    """Cumulative prompt-token accounting of one engine, from its scheduler's stats."""

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    total: int = 0
    requests: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of KV blocks in use (running requests and blocks pinned for transfer)."""
    transfers: int = 0
    """NIXL reads this engine made (prefill pulling history, decode reading prefill)."""
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    failed_transfers: int = 0
    expired_pins: int = 0
    """Pins the NixlConnector let go unread: expired or released early (decode), and
    reads declined because the owner's blocks were (nearly) expired (prefill)."""
    reads_after_release: int = 0
    """Reads of this engine's blocks reported after it had freed them: a reader got
    blocks another request may own. Must stay 0."""
    busy_steps: int = 0
    busy_step_s: float = 0.0
    """The engine's steps while it had requests running, and their seconds as the replica
    received them (`busy_step`): `busy_step_s / busy_steps` is its mean step under load.
    A step that began on an idle engine is none (its time would include the wait)."""
    prompt_steps: int = 0
    prompt_step_s: float = 0.0
    """Of those, the steps in which a prompt of more than `PROMPT_STEP_TOKENS` computed
    tokens got its first token (vLLM counts a prompt's tokens at that step; earlier chunks
    of a long one count as decode steps). The rest decoded, or took in KV read from
    another engine."""
    busy_step_seqs: int = 0
    """The requests running at each of those steps, summed: over `busy_steps`, the mean batch."""
    _last_step: float | None = field(default=None, repr=False, compare=False)

    def busy_step(self, now: float, running: int, prompt_tokens: int = 0) -> None:
        """A step's outputs reached the replica at `now` (monotonic seconds) with `running`
        requests scheduled, after computing `prompt_tokens` prompt tokens: the time since
        the previous step counts as one step, if the engine had requests running then too
        (an idle engine's wait is no step)."""
        if self._last_step is not None:
            self.busy_steps += 1
            self.busy_step_s += now - self._last_step
            self.busy_step_seqs += running
            if prompt_tokens > PROMPT_STEP_TOKENS:
                self.prompt_steps += 1
                self.prompt_step_s += now - self._last_step
        self._last_step = now if running > 0 else None

    def add_transfers(self, stats: dict) -> None:
        """Fold in the NixlConnector's transfer stats of one scheduler step."""
        durations = stats.get("transfer_duration") or []
        self.transfers += len(durations)
        self.transfer_s += float(sum(durations))
        self.transfer_bytes += int(sum(stats.get("bytes_transferred") or []))
        self.failed_transfers += len(stats.get("num_failed_transfers") or [])
        self.expired_pins += len(stats.get("num_kv_expired_reqs") or [])
        self.reads_after_release += len(stats.get("num_notifications_after_expiry") or [])

    def add(self, computed: int, local: int, external: int, total: int) -> None:
        self.computed += computed
        self.local_cache_hit += local
        self.external_kv_transfer += external
        self.total += total


@dataclass(frozen=True)
class KVBlocks:
    """An engine's KV blocks, read from its scheduler's own block pool.

    `total` usable blocks; `free` blocks a new request can get (free or evictable
    prefix-cache blocks); `pinned` blocks held by finished requests for a transfer (on
    decode: each conversation's last turn, kept for the next turn's pull);
    `pinned_requests` how many such requests."""

    total: int
    free: int
    pinned: int
    pinned_requests: int


class Engine(Protocol):
    """What an engine server needs from an inference engine."""

    async def start(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def counts(self) -> PromptTokenCounts: ...

    async def kv_blocks(self) -> KVBlocks | None:
        """The engine's block counts now; None if it cannot tell."""
        ...

    async def release(self, request_ids: Sequence[str]) -> list[str]:
        """Free now the blocks pinned for these finished requests (no reader will come).
        Returns the ids that were pinned here."""
        ...

    def shutdown(self) -> None: ...

    async def check_health(self) -> None:
        """Raise once the engine is dead (its core process exited or its output loop
        failed); Serve's health check calls it."""
        ...

    async def cpu_in_use(self) -> dict | None:
        """The OpenMP threads the engine's worker runs and the cores its model thread may
        use, read back from the worker; None where the engine cannot tell (GPU)."""
        ...

    @property
    def engine_id(self) -> str: ...

    @property
    def side_channel(self) -> tuple[str, int] | None:
        """(host, port) of its NIXL side channel; None without transfer."""
        ...

    @property
    def kv_blocks_total(self) -> int | None: ...

    @property
    def cpu_plan(self) -> Any:
        """How the app sized the engine's CPU threads (`app.engines.sizing.CpuPlan`); None on GPU."""
        ...


@dataclass
class EngineInfo:
    """What a server tells the ingress about itself."""

    replica_id: str
    engine_id: str
    side_channel: tuple[str, int] | None
    kv_blocks_total: int | None = None
