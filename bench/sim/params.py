"""Every parameter of the simulated fleet, with where it comes from.

Two hardware sets:

* `cpu_fleet()`: the fleet study's 2-core VM, the embedded model's dimensions
  (`fleet-qwen3`: 4 layers, hidden 256, 2 KV heads of 64, float32). Fitted from figures
  measured on this VM class with the same model dimensions in docs/benchmarks.md (the
  chat and agentic profiles) and the store's own benchmark (docs/store.md), never from
  the fleet study it is validated against.
* `gpu_qwen3_32b(tp, gpu, mfu)`: Qwen3-32B in bf16 on p5en (H200) or p5 (H100) GPUs,
  from the model's published configuration and the GPUs' and EFA's published figures.
  Two figures have no published source and are marked as assumptions; `mfu` is fitted
  to the published one-way TTFT (`bench.sim.validate`).

`Param` rows (name, value, source, the projection it moves most) are what
`python -m bench.sim --params` prints and docs/benchmarks.md lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.sim.costs import EngineCost, Link, fit_token_s, gpu_cost

GB = 1e9


@dataclass(frozen=True)
class Param:
    name: str
    value: str
    source: str
    moves: str
    """The projection (or validation figure) this parameter moves most."""


@dataclass(frozen=True)
class Hardware:
    name: str
    engine: EngineCost
    link: Link
    """NIXL between a prefill and a decode engine (either direction)."""
    kv_bytes_per_token: int
    block_size: int
    kv_blocks: int
    """KV blocks of one engine (what vLLM allocates: the pinned budget's base)."""
    ingress_s: float
    """The ingress's and client's own work on a turn's way to its first token (HTTP,
    template, tokenizer, detokenizer), outside the engines, hops and store."""
    hop_s: float
    """One Serve call from the ingress to an engine replica, and its answer's first chunk back."""
    store_call_s: float
    """A turn's claim from the handle store, as the ingress waits for it."""
    store_turns_per_s: float
    """Turns one store shard serves per second at most (measured)."""
    gpus_per_engine: int
    hbm_bytes_per_engine: float
    """Accelerator memory of one engine's GPUs (0 on CPU)."""
    params: tuple[Param, ...] = ()


# -- the CPU fleet study's VM ------------------------------------------------------------

CPU_STEP_S = 0.0065
CPU_DECODE_SEQ_S = 0.0005
CPU_DECODE_CTX_S = 6e-7
CPU_ATTN_RATIO = 8e-4
CPU_PREFILL_POINTS = ((335, 1108, 0.072), (335, 1108, 0.0668))
"""(new tokens, cached tokens, seconds) of prefill legs measured alone on the embedded
model: the chat profile through prefill (prefill engine 72 ms) and on decode (decode
engine 66.8 ms), turns 2-6 of ~335 new tokens over 434-1,782 cached (docs/benchmarks.md,
"The fixed cost of P/D per turn")."""


def cpu_fleet() -> Hardware:
    token_s = fit_token_s(CPU_PREFILL_POINTS, CPU_STEP_S, CPU_ATTN_RATIO)
    engine = EngineCost(
        step_s=CPU_STEP_S,
        token_s=token_s,
        attn_s=CPU_ATTN_RATIO * token_s,
        decode_seq_s=CPU_DECODE_SEQ_S,
        decode_ctx_s=CPU_DECODE_CTX_S,
        chunk_tokens=2048,
    )
    kv_bytes = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head_dim x float32
    doc = "docs/benchmarks.md"
    params = (
        Param(
            "step_s",
            f"{CPU_STEP_S * 1e3:.1f} ms",
            f"{doc} chat profile: ITL 7.4-8.5 ms at one stream over 0.4-2k tokens",
            "ITL p99 (every mode)",
        ),
        Param(
            "decode_ctx_s",
            f"{CPU_DECODE_CTX_S * 1e9:.0f} ns/token",
            f"{doc} chat profile ITL rising with context (7.4 -> 8.5 ms)",
            "ITL p99 at long histories",
        ),
        Param(
            "decode_seq_s",
            f"{CPU_DECODE_SEQ_S * 1e3:.1f} ms/seq",
            f"{doc} agentic profile: ITL 13-25 ms with two streams to ~6k tokens (with decode_ctx_s)",
            "ITL p99 at many agents",
        ),
        Param(
            "token_s",
            f"{token_s * 1e6:.1f} us/token",
            f"least squares over {doc} chat profile legs: prefill engine 72 ms, decode 66.8 ms "
            "for ~335 new over ~1.1k cached",
            "TTFT of oneway; goodput of bidir-pd (prefill saturation)",
        ),
        Param(
            "attn_s / token_s",
            f"{CPU_ATTN_RATIO:.0e} per context token",
            "NOTES.md 12-layer cold-prefill curve (1k-8k: 0.31-4.95 s), scaled by the models' "
            "attention width over dense parameters (fleet-qwen3 vs bench-qwen3)",
            "oneway TTFT at 4-8k histories",
        ),
        Param("chunk_tokens", "2048", "vLLM 0.32 default for AsyncLLM (SchedulerConfig)", "ITL p99"),
        Param(
            "NIXL link",
            "7.4 ms + 3.3 GB/s",
            f"{doc}: 5 reads of 536 MB in 0.20 s (cpu profile) and 46 reads of 562 MB in 0.51 s "
            "(agentic), solved for latency and bandwidth",
            "bidir-pd TTFT",
        ),
        Param(
            "ingress_s",
            "27.4 ms",
            f"{doc} chat profile: client TTFT 106 ms less store 2.5, decode engine 66.8, transport 9.3",
            "TTFT p50 of short turns",
        ),
        Param("hop_s", "10 ms", f"{doc} chat profile: two transports 20 ms through prefill", "TTFT p50"),
        Param("store_call_s", "2.5 ms", f"{doc} chat profile: store 2.5 ms a turn", "TTFT p50"),
        Param(
            "store shard",
            "2,000 turns/s",
            "docs/store.md: one shard 2,000-2,600 turns/s under a fleet's load",
            "store calls / shard capacity",
        ),
        Param("kv per engine", "1 GiB", "bench/profiles.py kv_cache_bytes (fleet profile)", "pinned KV"),
    )
    return Hardware(
        name="cpu-2core",
        engine=engine,
        link=Link(latency_s=0.0074, bytes_per_s=3.3 * GB),
        kv_bytes_per_token=kv_bytes,
        block_size=32,
        kv_blocks=(1 << 30) // (kv_bytes * 32),
        ingress_s=0.0274,
        hop_s=0.010,
        store_call_s=0.0025,
        store_turns_per_s=2000.0,
        gpus_per_engine=0,
        hbm_bytes_per_engine=0.0,
        params=params,
    )


# -- Qwen3-32B on p5en (H200) / p5 (H100) ------------------------------------------------

QWEN3_32B: dict[str, Any] = {
    "params": 31.2e9,  # non-embedding parameters, Qwen3-32B model card
    "weight_bytes": 32.8e9 * 2,  # 32.8B parameters in bf16
    "layers": 64,
    "attn_width": 64 * 128,  # 64 query heads x head_dim 128 (config.json)
    "kv_bytes_per_token": 64 * 2 * 8 * 128 * 2,  # layers x (K, V) x 8 KV heads x 128 x bf16
}
GPUS = {
    # bf16 dense FLOP/s, HBM bytes, HBM bytes/s: NVIDIA H200 / H100 SXM datasheets
    "h200": (989e12, 141e9, 4.8e12),
    "h100": (989e12, 80e9, 3.35e12),
}
EFA_BYTES_PER_S_PER_GPU = 400e9 / 8
"""p5en: 3,200 Gbps of EFA per instance of 8 GPUs (AWS instance page)."""
GPU_HBM_EFFICIENCY = 0.7
"""Assumption (no published figure used): share of HBM bandwidth a decode step reaches."""
GPU_STEP_OVERHEAD_S = 0.004
"""Assumption (no published figure used): scheduling and launch cost of one step."""
GPU_NIXL_LATENCY_S = 0.064
"""Fixed cost of one NIXL read: with EFA bandwidth, a 24k-token pull at TP8 costs 80 ms,
the middle of the published 30-130 ms transfer cost (NOTES.md, AWS write-up)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default gpu_memory_utilization: the share of HBM for weights and KV."""


def gpu_qwen3_32b(
    tp: int = 8,
    gpu: str = "h200",
    mfu: float = 0.45,
    *,
    hbm_efficiency: float = GPU_HBM_EFFICIENCY,
    step_overhead_s: float = GPU_STEP_OVERHEAD_S,
    nixl_latency_s: float = GPU_NIXL_LATENCY_S,
    efa_bytes_per_s_per_gpu: float = EFA_BYTES_PER_S_PER_GPU,
    memory_utilization: float = GPU_MEMORY_UTILIZATION,
) -> Hardware:
    """Qwen3-32B engines of `tp` GPUs; the keyword arguments move one parameter off its
    source (`bench.sim.project.sensitivity`)."""
    peak, hbm, bandwidth = GPUS[gpu]
    m = QWEN3_32B
    engine = gpu_cost(
        params=m["params"],
        layers=m["layers"],
        attn_width=m["attn_width"],
        weight_bytes=m["weight_bytes"],
        kv_bytes_per_token=m["kv_bytes_per_token"],
        tp=tp,
        peak_flops=peak,
        mfu=mfu,
        hbm_bytes_per_s=bandwidth,
        hbm_efficiency=hbm_efficiency,
        step_overhead_s=step_overhead_s,
        chunk_tokens=2048,
    )
    kv_bytes = hbm * tp * memory_utilization - m["weight_bytes"]
    src_gpu = f"NVIDIA {gpu.upper()} datasheet"
    params = (
        Param("model", "Qwen3-32B bf16", "Qwen3-32B config.json / model card", "-"),
        Param(
            "dense params", "31.2e9", "Qwen3-32B model card (non-embedding)", "prefill time: TTFT, P:D ratio"
        ),
        Param(
            "KV bytes/token",
            f"{m['kv_bytes_per_token']:,}",
            "64 layers x 8 KV heads x 128 x bf16",
            "pinned KV",
        ),
        Param("peak bf16", f"{peak / 1e12:.0f} TFLOP/s per GPU", src_gpu, "prefill time"),
        Param("HBM", f"{hbm / 1e9:.0f} GB, {bandwidth / 1e12:.2f} TB/s", src_gpu, "decode ITL, pinned KV"),
        Param(
            "TP", str(tp), "the published 1P1D ran TP8 (validation); projections TP2", "engines per GPU count"
        ),
        Param(
            "MFU", f"{mfu:.3f}", "fitted to the published one-way TTFT 778 ms at 24k", "every TTFT, goodput"
        ),
        Param("EFA", "50 GB/s per GPU", "AWS p5en: 3,200 Gbps per 8 GPUs", "bidir pull time"),
        Param(
            "NIXL latency",
            f"{GPU_NIXL_LATENCY_S * 1e3:.0f} ms",
            "24k pull = 80 ms, mid of 30-130 ms",
            "bidir TTFT",
        ),
        Param("HBM efficiency", f"{GPU_HBM_EFFICIENCY}", "ASSUMPTION (not published)", "ITL p99"),
        Param(
            "step overhead", f"{GPU_STEP_OVERHEAD_S * 1e3:.0f} ms", "ASSUMPTION (not published)", "ITL p99"
        ),
        Param("chunk_tokens", "2048", "vLLM 0.32 default for AsyncLLM (SchedulerConfig)", "ITL p99"),
        Param(
            "hop_s, store_call_s, ingress_s", "10, 2.5, 27.4 ms", "CPU-measured (host-side work)", "TTFT p50"
        ),
    )
    return Hardware(
        name=f"qwen3-32b-{gpu}-tp{tp}",
        engine=engine,
        link=Link(latency_s=nixl_latency_s, bytes_per_s=efa_bytes_per_s_per_gpu * tp),
        kv_bytes_per_token=m["kv_bytes_per_token"],
        block_size=32,
        kv_blocks=int(kv_bytes // (m["kv_bytes_per_token"] * 32)),
        ingress_s=0.0274,
        hop_s=0.010,
        store_call_s=0.0025,
        store_turns_per_s=2000.0,
        gpus_per_engine=tp,
        hbm_bytes_per_engine=hbm * tp,
        params=params,
    )
