"""The engine replicas' sections: each role's replicas, resources and autoscaling, and how
KV moves between engines (transfer, placement of a turn)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from app.config.base import Strict


class AutoscalingRoleConfig(Strict):
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


class EngineRoleConfig(Strict):
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


class TransferConfig(Strict):
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
    prefill_hosts: bool = Field(
        False,
        description=(
            "bidir with prefix caching on prefill: while no prefill leg is in flight a prefill "
            "replica hosts sessions as a decode replica does (their turns computed and streamed "
            "there, as data parallel engines would, its prompts in `decode_chunk_tokens` chunks), "
            "and hands each to decode through an ordinary P/D turn once legs run or its streams "
            "come late (`itl_target_ms`). Off: prefill only runs legs."
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
    itl_late_fraction: float = Field(
        0.005,
        ge=0,
        lt=1,
        description=(
            "`placement: priced`: the share of a decode replica's recent outputs that may come later "
            "than `itl_target_ms` (the target is a p99: 0.01 would spend all of it). The policy spends "
            "it on decode-local turns that stretch the streams' steps past the target, and sends every "
            "turn through prefill while the streams there come late beyond it. 0: never stretch them."
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
        500.0,
        ge=0,
        description=(
            "While an engine holds finished turns' blocks for transfer and has nothing to compute, "
            "it checks transfer completions this often instead of stepping every millisecond "
            "(new requests, releases and block queries still wake it at once). Each check is an "
            "empty step through the worker and the replica; only the freeing of blocks a reader "
            "already finished (or whose TTL passed) waits for it. 0: vLLM's own loop."
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
