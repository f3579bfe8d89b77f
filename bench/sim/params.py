"""Every parameter of the simulated fleet, with where it comes from.

Two hardware sets:

* `cpu_fleet()`: the fleet study's 2-core VM, the embedded model's dimensions
  (`fleet-qwen3`: 4 layers, hidden 256, 2 KV heads of 64, float32). The engine's costs
  are least-squares fits over a grid of single-engine measurements on this VM
  (`python -m bench.prefill_cost --grid`: prefill legs by history and new tokens, decode
  steps by batch and history); the hops, the ingress and NIXL from the chat and agentic
  profiles in docs/benchmarks.md, the store from its own benchmark (docs/store.md); never
  from the fleet study it is validated against. The engines share the VM's 2 cores with
  the serving processes (`bench.sim.engine.HostCpu`), whose CPU per turn and per-leg
  overhead come from later runs of the study (their own accounting and timings).
* `gpu_qwen3_32b(tp, gpu, mfu)`: Qwen3-32B in bf16 on p5en (H200) or p5 (H100) GPUs, from
  published figures (model, GPUs, EFA, NIXL), two marked as assumptions; `mfu` is fitted
  to the published one-way TTFT (`bench.sim.published`).

`Param` rows (name, value, source, the projection it moves most) are what
`python -m bench.sim --params` prints and docs/simulation.md lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bench.sim.costs import EngineCost, Grid, Jitter, Link, fit_decode, fit_prefill, gpu_cost

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
    cores: float = 0.0
    """Cores the engines share with the serving processes (`bench.sim.engine.HostCpu`);
    0: each engine has its own (GPU engines)."""
    leg_s: float = 0.0
    """An engine leg's time to its first output beyond the engine's own steps: the
    replica's request handling and the front end's output path (0 on GPU: no figure)."""
    host_cpu_per_turn_s: float = 0.0
    """CPU seconds the serving processes (ingress, proxy, engine front ends and schedulers,
    client) spend on one turn, beside the engines' model work."""
    itl_jitter: Jitter = ()
    """How an output's gap at the client spreads around its engine's step (`costs.Jitter`);
    the ingress sees the same. Empty: not at all (GPU: no figure)."""
    step_wait_s: float = 0.0
    """What every engine step takes in the fleet beyond its compute, for engines without
    the NixlConnector (dp's): the step loop's hand-offs between processes on shared cores,
    which an engine alone (the grid) does not wait for (0 on GPU: no figure)."""
    step_wait_nixl_s: float = 0.0
    """The same for the P/D engines, which run the NixlConnector."""


# -- the CPU fleet study's VM ------------------------------------------------------------

CPU_GRID_COMMAND = (
    "python -m bench.prefill_cost --grid --model fleet-qwen3 --compiled --reps 3 --batches 1,4,8"
)
"""What measured the grid below (results/prefill_cost_grid.json): one engine of the fleet
study's model and settings (float32, compiled, one OpenMP thread), alone on the 2-core VM
on 2026-12-06; medians of 3 requests a point."""
CPU_PREFILL_GRID: tuple[tuple[int, int, float], ...] = (
    (64, 0, 0.0104),
    (256, 0, 0.0261),
    (1024, 0, 0.1063),
    (64, 2048, 0.021),
    (256, 2048, 0.0551),
    (1024, 2048, 0.2155),
    (64, 6144, 0.0379),
    (256, 6144, 0.1103),
    (1024, 6144, 0.4488),
    (64, 12288, 0.0605),
    (256, 12288, 0.1865),
    (1024, 12288, 0.7081),
    (64, 24576, 0.1195),
    (256, 24576, 0.3589),
    (1024, 24576, 1.3382),
)
"""(new tokens computed, cached tokens, seconds to the first output) per grid point."""
CPU_DECODE_GRID: tuple[tuple[int, int, float], ...] = (
    (1, 0, 0.00448),
    (4, 0, 0.00494),
    (8, 0, 0.00582),
    (1, 2048, 0.00579),
    (1, 6144, 0.00793),
    (1, 12288, 0.01095),
    (1, 24576, 0.01566),
)
"""(sequences decoding, context tokens of each, seconds a step): the grid's single
sequences at each history, and its batches at history 0. In that run the batches over a
history all decoded over one shared history (its KV most likely served from the CPU's
cache) and cost 2-3x less a sequence than single ones, where the fleet's streams each
read their own: those points are left out, and `CPU_DECODE_OWN_GRID` stands in for them."""
CPU_DECODE_OWN_GRID: tuple[tuple[int, int, float], ...] = (
    (1, 2048, 0.00426),
    (4, 2048, 0.00678),
    (8, 2048, 0.01126),
    (1, 6144, 0.00621),
    (4, 6144, 0.01415),
    (8, 6144, 0.02428),
    (1, 12288, 0.00950),
    (4, 12288, 0.02398),
    (8, 12288, 0.04392),
    (1, 24576, 0.01440),
    (4, 24576, 0.04237),
    (8, 24576, 0.08229),
)
"""The same command's decode steps on 2026-12-06 (results/prefill_cost_grid_own.json), each
sequence over its own history, as the fleet's streams are: the batches of 4 and 8 at each
history, and the single sequence they are compared with. That run was 8-27% faster on the
single sequences than the grid above (the VM from one session to the next), so its batches
enter the fit at the grid's level: each at its ratio to that run's single sequence
(`decode_points`)."""


def decode_points() -> tuple[tuple[int, int, float], ...]:
    """The decode fit's points: `CPU_DECODE_GRID`, and each batch of `CPU_DECODE_OWN_GRID`
    over a history scaled by the grid's single sequence over that history against its own."""
    single = {context: s for n, context, s in CPU_DECODE_GRID if n == 1}
    own_single = {context: s for n, context, s in CPU_DECODE_OWN_GRID if n == 1}
    batches = tuple(
        (n, context, s * single[context] / own_single[context])
        for n, context, s in CPU_DECODE_OWN_GRID
        if n > 1
    )
    return CPU_DECODE_GRID + batches


CPU_ITL_JITTER: Jitter = (
    (0.61, 0.25),
    (0.91, 0.25),
    (1.08, 0.25),
    (1.31, 0.15),
    (1.58, 0.05),
    (1.86, 0.03),
    (2.18, 0.01),
    (2.4, 0.005),
    (2.69, 0.003),
    (3.0, 0.002),
)
"""The serving path's jitter on this VM (`costs.jitter_of`, printed by `python -m bench.sim
--jitter FILE`): the client's gaps in the fleet study of 2026-12-06 (`python -m bench
--profile fleet --modes dp,bidir,bidir-pd --level-sessions 3`, not the validated run),
bidir-pd at 4 agents, where decode engines compute no prompt: 3,668 gaps over their
stream's median, p90 1.5x, p99 2.3x. Two other runs (one of them at 8 agents) gave the
same bins within 0.1x up to p95 and 0.2x at p99."""
CPU_LEG_S = 0.010
"""An engine leg's time to its first output beyond the grid's prediction (`Hardware.leg_s`)."""
CPU_HOST_CPU_PER_TURN_S = 0.20
"""The serving processes' CPU seconds per turn in the fleet study (`Hardware.host_cpu_per_turn_s`)."""


def cpu_fleet(grid: Grid | None = None) -> Hardware:
    """The fleet study's VM, its engine fitted on the grid of 2026-12-06 (the constants
    above) or on `grid`."""
    prefill_points = grid.prefill if grid else CPU_PREFILL_GRID
    step_points = grid.decode if grid else decode_points()
    fixed, token_s, attn_s, chunk_ctx_s = fit_prefill(prefill_points)
    step_s, seq_s, ctx_s = fit_decode(step_points)
    engine = EngineCost(
        step_s=step_s,
        token_s=token_s,
        attn_s=attn_s,
        decode_seq_s=seq_s,
        decode_ctx_s=ctx_s,
        chunk_tokens=2048,
        chunk_s=max(0.0, fixed - step_s),
        chunk_ctx_s=chunk_ctx_s,
    )
    kv_bytes = 4 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head_dim x float32
    doc = "docs/benchmarks.md"
    command = f"`{CPU_GRID_COMMAND}`" + (f" ({grid.source})" if grid else "")
    histories = _spread(c for _, c, _ in prefill_points)
    news = _spread(n for n, _, _ in prefill_points)
    batches = _spread(b for b, _, _ in step_points)
    params = (
        Param(
            "step_s",
            f"{step_s * 1e3:.2f} ms",
            f"least squares over the grid's decode steps ({command}): one sequence over each history, "
            "1-8 sequences over none, and 4-8 sequences each over its own history (a later run, "
            "scaled to the grid's level)",
            "ITL p99 (every mode)",
        ),
        Param(
            "decode_seq_s",
            f"{seq_s * 1e3:.3f} ms/seq",
            f"the same fit: batches of {batches} sequences",
            "ITL p99 at many agents",
        ),
        Param(
            "decode_ctx_s",
            f"{ctx_s * 1e9:.1f} ns/token",
            f"the same fit: sequences over histories {histories} tokens",
            "ITL p99 at long histories",
        ),
        Param(
            "chunk_s",
            f"{max(0.0, fixed - step_s) * 1e3:.2f} ms",
            f"the grid's prefill fit: fixed {fixed * 1e3:.2f} ms a leg, less step_s",
            "TTFT p50 of short turns",
        ),
        Param(
            "token_s",
            f"{token_s * 1e6:.2f} us/token",
            f"least squares over the grid's prefill legs ({command}): new {news} over histories "
            f"{histories} tokens",
            "TTFT of oneway; goodput of bidir-pd (prefill saturation)",
        ),
        Param(
            "attn_s",
            f"{attn_s * 1e9:.1f} ns/token per context token",
            "the same fit",
            "oneway TTFT at 4-8k histories",
        ),
        Param(
            "chunk_ctx_s",
            f"{chunk_ctx_s * 1e9:.0f} ns per cached token a chunk",
            "the same fit (short legs over long histories)",
            "TTFT of decode-local turns at long histories",
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
        Param(
            "leg_s",
            f"{CPU_LEG_S * 1e3:.0f} ms",
            "the fleet study's engine timings at 4 agents (2026-12-06 runs, not the validated one): "
            "`decode_engine_s` and `prefill_engine_s` less the grid's prediction, medians 9-15 ms",
            "TTFT p50 of short turns",
        ),
        Param(
            "ITL jitter",
            "p90 1.5x, p99 2.3x a step",
            "the fleet study's client gaps over their stream's median (`python -m bench --profile fleet "
            "--modes dp,bidir,bidir-pd --level-sessions 3`, 2026-12-06, bidir-pd at 4 agents)",
            "ITL p99 at 4-8 agents",
        ),
        Param(
            "step wait",
            "none (dp's engines and the P/D engines' apart, with --steps)",
            "`--steps OTHER_RUN`: fitted on another run's decode steps (`bench.sim.stepwait`; 3.0, 5.6 ms)",
            "ITL p99 and the meets at 4-8 agents",
        ),
        Param("cores", "2", "the VM's", "ITL p99 and goodput at 16+ agents"),
        Param(
            "host CPU per turn",
            f"{CPU_HOST_CPU_PER_TURN_S:.2f} s",
            "`bench.hostcpu` around each level of `--profile fleet --modes dp,oneway,bidir,bidir-pd` "
            "(2026-12-06): 0.13-0.32 s a turn over its 12 levels",
            "ITL p99 and goodput at 16+ agents",
        ),
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
        cores=2.0,
        host_cpu_per_turn_s=CPU_HOST_CPU_PER_TURN_S,
        leg_s=CPU_LEG_S,
        itl_jitter=CPU_ITL_JITTER,
    )


def _spread(values: Iterable[int]) -> str:
    seen = sorted(set(values))
    return f"{seen[0]:,}-{seen[-1]:,}" if seen else "-"


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
"""Fixed cost of one NIXL transfer: a 24k-token pull at TP8 then costs 80 ms, the middle of
the AWS write-up's 30-130 ms."""
GPU_NIXL_HANDOFF_S = 0.197 - 0.029 - 0.058
"""A read's hand-off past its transfer and first step: vLLM RFC #50913 (`bench.sim.published`)."""
GPU_NIXL_READ_S = GPU_NIXL_LATENCY_S + GPU_NIXL_HANDOFF_S
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default gpu_memory_utilization: the share of HBM for weights and KV."""


def gpu_qwen3_32b(
    tp: int = 8,
    gpu: str = "h200",
    mfu: float = 0.45,
    *,
    hbm_efficiency: float = GPU_HBM_EFFICIENCY,
    step_overhead_s: float = GPU_STEP_OVERHEAD_S,
    nixl_latency_s: float = GPU_NIXL_READ_S,
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
            "MFU",
            f"{mfu:.3f}",
            "fitted to the published one-way mean TTFT 778 ms (vLLM's multi-turn benchmark, "
            "first prompts of 24k tokens: `bench.sim.published`)",
            "every TTFT, goodput",
        ),
        Param("EFA", "50 GB/s per GPU", "AWS p5en: 3,200 Gbps per 8 GPUs", "bidir pull time"),
        Param(
            "NIXL latency",
            f"{GPU_NIXL_LATENCY_S * 1e3:.0f} ms",
            "24k pull = 80 ms, mid of 30-130 ms",
            "bidir TTFT",
        ),
        Param("NIXL hand-off", "110 ms a read", "vLLM RFC #50913 (8 L20): an upper reading", "bidir TTFT"),
        Param("HBM efficiency", f"{GPU_HBM_EFFICIENCY}", "ASSUMPTION (not published)", "ITL p99"),
        Param(
            "step overhead", f"{GPU_STEP_OVERHEAD_S * 1e3:.0f} ms", "ASSUMPTION (not published)", "ITL p99"
        ),
        Param("chunk_tokens", "2048", "vLLM 0.32 default for AsyncLLM (SchedulerConfig)", "ITL p99"),
        Param(
            "hop_s, store_call_s, ingress_s, leg_s",
            "10, 2.5, 27.4, 10 ms",
            "CPU-measured (host-side work)",
            "TTFT p50",
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
        leg_s=CPU_LEG_S,
    )
