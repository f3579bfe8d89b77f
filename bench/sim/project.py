"""`python -m bench.sim --project`: PROJECTIONS (simulated, not measured) of the fleet on
8-64 GPUs serving agent traces shaped like vLLM's AgentX traces.

Hardware: Qwen3-32B in bf16, one engine per two H200s (TP2; `params.gpu_qwen3_32b`, MFU
as fitted to the published one-way TTFT). Workload (`AGENTX`): sessions of 43 turns at
the median, tool results of ~1.5k tokens with a heavy tail, 444-token answers, histories
growing to ~140k tokens, sub-agents in ~30% of families; the AgentX figures give the
medians (turns, input, output); the spread, pauses and system prompt are assumptions.

Per GPU count and mode, agents ramp over `AGENTS_PER_ENGINE` x engines (each level a
fresh fleet after a warm-up session; a level stops as soon as its TTFT p90 cannot hold)
until a level misses the fleet study's target (TTFT p90 <= 2 s, ITL p99 <= 50 ms). P/D
modes try each prefill share in `PREFILL_SHARES`; the best is reported with its P:D.
Reported: goodput (turns/s at the target) and its agents; TTFT p50 by history bucket and
ITL p99 at the level every mode ran (0.5 agents per engine); at the goodput level (else
the first), the pinned KV's peak share of one decode engine's HBM and the store's turns/s
against one shard's measured capacity.
"""

from __future__ import annotations

import time
from typing import Any

from bench.fleet import SLO
from bench.sim.fleet import Fleet, FleetSpec
from bench.sim.params import (
    EFA_BYTES_PER_S_PER_GPU,
    GPU_HBM_EFFICIENCY,
    GPU_MEMORY_UTILIZATION,
    GPU_NIXL_READ_S,
    GPU_STEP_OVERHEAD_S,
    Hardware,
    gpu_qwen3_32b,
)
from bench.sim.published import fit_mfu
from bench.sim.study import level_figures, level_trace, warmup_trace
from bench.traces import TraceShape

GPU_COUNTS = (8, 16, 32, 64)
TP = 2
MODES = ("dp", "oneway", "bidir-pd", "bidir", "bidir-nopin")
"""`bidir`: the app's default placement; `bidir-nopin`: the same without pinned handles."""
AGENTS_PER_ENGINE = (0.5, 1, 1.5, 2, 3, 4, 6, 8)
PREFILL_SHARES = (0.25, 0.5, 0.75)
EDGES = ((0, 32_000), (32_000, 64_000), (64_000, 128_000), (128_000, 1 << 30))
LONG_TOOL = 8_000
AGENTX = TraceShape(
    sessions=16,
    turns_median=43,
    turns_sigma=0.5,
    turns_max=120,
    system_tokens=20_000,
    user_tokens=200,
    tool_prob=0.85,
    tool_median_tokens=1_500,
    tool_sigma=1.1,
    tool_max_tokens=40_000,
    answer_median_tokens=444,
    answer_sigma=0.6,
    pause_median_s=2.0,
    subagent_prob=0.3,
    max_history_tokens=160_000,
    seed=7,
)


def _level(spec: FleetSpec, agents: int, slo: SLO) -> dict[str, Any]:
    fleet = Fleet(spec)
    fleet.run(warmup_trace(AGENTX))
    run = fleet.run(level_trace(AGENTX, agents), ttft_bound=(slo.ttft_p90_s, 0.9))
    figures = level_figures(run, slo, EDGES, LONG_TOOL)
    hw = spec.hw
    pinned = run.peak_pinned_blocks * hw.block_size * hw.kv_bytes_per_token
    figures["pinned_hbm_share"] = pinned / hw.hbm_bytes_per_engine
    figures["store_load"] = (figures["turns_per_s"] or 0.0) / hw.store_turns_per_s
    return {"agents": agents, **figures}


def ramp(spec: FleetSpec, engines: int, slo: SLO) -> dict[str, Any]:
    """Levels until the first miss; the best level that met the target (or the first)."""
    levels = []
    for per_engine in AGENTS_PER_ENGINE:
        levels.append(_level(spec, max(1, round(per_engine * engines)), slo))
        if not levels[-1]["meets_slo"]:
            break
    meeting = [lv for lv in levels if lv["meets_slo"]]
    best = max(meeting, key=lambda lv: lv["turns_per_s"]) if meeting else None
    return {"levels": levels, "best": best}


def run(
    hw: Hardware | None = None, slo: SLO | None = None, transfer: tuple[tuple[str, Any], ...] = ()
) -> dict[str, Any]:
    """Every GPU count and mode ramped (`ramp`), the best P:D of each; `transfer`: the app's
    `transfer.*` settings changed, as `--transfer` changes them."""
    started = time.perf_counter()
    slo = slo or SLO()
    hw = hw or gpu_qwen3_32b(tp=TP, mfu=fit_mfu())
    rows = []
    for gpus in GPU_COUNTS:
        engines = gpus // TP
        for mode in MODES:
            shares = {min(engines - 1, max(1, round(engines * s))) for s in PREFILL_SHARES}
            splits = [0] if mode == "dp" else sorted(shares)
            tried = []
            for prefill in splits:
                decode = engines if mode == "dp" else engines - prefill
                spec = FleetSpec(mode, hw, prefill=prefill, decode=decode, transfer=transfer)
                tried.append({"prefill": prefill, "decode": decode, **ramp(spec, engines, slo)})
            good = [t for t in tried if t["best"]]
            pick = max(good, key=lambda t: t["best"]["turns_per_s"]) if good else tried[0]
            shown = pick["best"] or pick["levels"][0]
            rows.append(
                {
                    "gpus": gpus,
                    "mode": mode,
                    "prefill": pick["prefill"],
                    "decode": pick["decode"],
                    "goodput": pick["best"]["turns_per_s"] if pick["best"] else None,
                    "agents": pick["best"]["agents"] if pick["best"] else None,
                    "level": shown,
                    "common": pick["levels"][0],
                    "splits": [
                        {"prefill": t["prefill"], "goodput": t["best"] and t["best"]["turns_per_s"]}
                        for t in tried
                    ],
                }
            )
    return {
        "hardware": hw.name,
        "slo": {"ttft_p90_s": slo.ttft_p90_s, "itl_p99_s": slo.itl_p99_s},
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(result: dict[str, Any]) -> str:
    names = _bucket_names()
    lines = [
        f"PROJECTION (simulated, not measured): {result['hardware']}, AgentX-shaped traces, target "
        f"TTFT p90 <= {result['slo']['ttft_p90_s']} s, ITL p99 <= {result['slo']['itl_p99_s'] * 1e3:.0f} ms",
        "",
        "| GPUs | mode | best P:D | goodput (turns/s) | agents | TTFT p50 "
        + " / ".join(names)
        + " (s) at 0.5 agents/engine | TTFT p90 (s) there | ITL p99 (ms) there | pinned KV / HBM (peak) "
        "| store load |",
        "| ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lv, common = r["level"], r["common"]
        ttft = " / ".join(_s(common["buckets"][n]["ttft_p50_s"]) for n in names)
        pd = "-" if r["mode"] == "dp" else f"{r['prefill']}:{r['decode']}"
        itl = "-" if common["itl_p99_s"] is None else f"{common['itl_p99_s'] * 1e3:.0f}"
        agents = "-" if r["agents"] is None else str(r["agents"])
        lines.append(
            f"| {r['gpus']} | {r['mode']} | {pd} | {_s(r['goodput'])} | {agents} | {ttft} | "
            f"{_s(common['ttft_p90_s'])} | {itl} | "
            f"{lv['pinned_hbm_share']:.0%} | {lv['store_load']:.2%} |"
        )
    lines.append(f"\n({result['seconds']} s)")
    return "\n".join(lines)


def _bucket_names() -> list[str]:
    return [f"{lo // 1000}-{hi // 1000}k" if hi < 1 << 30 else f"{lo // 1000}k+" for lo, hi in EDGES]


def plot(result: dict[str, Any], path: str) -> None:
    """Goodput against GPUs per mode, and TTFT p50 by history bucket at the largest fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _bucket_names()
    most = max(GPU_COUNTS)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        left.plot([r["gpus"] for r in rows], [r["goodput"] or 0.0 for r in rows], marker="o", label=mode)
        at = next(r for r in rows if r["gpus"] == most)["common"]["buckets"]
        ys = [at[n]["ttft_p50_s"] for n in names]
        right.plot(names, [y if y is not None else float("nan") for y in ys], marker="o", label=mode)
    left.set_xscale("log", base=2)
    left.minorticks_off()
    left.set_xticks(GPU_COUNTS, [str(g) for g in GPU_COUNTS])
    left.set(xlabel="GPUs (H200, TP2 engines)", ylabel="goodput (turns/s at the target)")
    right.set(
        xlabel="history (prompt tokens)",
        ylabel=f"TTFT p50 (s), {most} GPUs, 0.5 agents/engine",
        yscale="log",
    )
    left.legend(fontsize=8)
    fig.suptitle(f"PROJECTION (simulated, not measured): {result['hardware']}, AgentX-shaped traces")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SENSITIVITY_GPUS = 16
SENSITIVITY_MODES = ("dp", "bidir-pd", "bidir")


def sensitivity(slo: SLO | None = None, scale: float = 1.25) -> dict[str, Any]:
    """Which figure each GPU parameter moves most: the 16-GPU projection of three modes
    with one parameter at `scale` times its value (latency-like ones too), against the
    unchanged one. Figures: each mode's goodput (best P:D) and TTFT p50 over all turns at
    0.5 agents per engine."""
    slo = slo or SLO()
    mfu = fit_mfu()
    base = {
        "mfu": mfu,
        "hbm_efficiency": GPU_HBM_EFFICIENCY,
        "step_overhead_s": GPU_STEP_OVERHEAD_S,
        "nixl_latency_s": GPU_NIXL_READ_S,
        "efa_bytes_per_s_per_gpu": EFA_BYTES_PER_S_PER_GPU,
        "memory_utilization": GPU_MEMORY_UTILIZATION,
    }

    def figures(**change: float) -> dict[str, float | None]:
        k = {**base, **change}
        hw = gpu_qwen3_32b(
            tp=TP,
            mfu=k["mfu"],
            hbm_efficiency=k["hbm_efficiency"],
            step_overhead_s=k["step_overhead_s"],
            nixl_latency_s=k["nixl_latency_s"],
            efa_bytes_per_s_per_gpu=k["efa_bytes_per_s_per_gpu"],
            memory_utilization=k["memory_utilization"],
        )
        engines = SENSITIVITY_GPUS // TP
        out: dict[str, float | None] = {}
        for mode in SENSITIVITY_MODES:
            best, first = None, None
            splits = [0] if mode == "dp" else sorted({max(1, round(engines * s)) for s in PREFILL_SHARES})
            for prefill in splits:
                decode = engines if mode == "dp" else engines - prefill
                tried = ramp(FleetSpec(mode, hw, prefill=prefill, decode=decode), engines, slo)
                first = first or tried["levels"][0]
                if tried["best"] and (best is None or tried["best"]["turns_per_s"] > best):
                    best = tried["best"]["turns_per_s"]
            out[f"{mode} goodput"] = best
            out[f"{mode} TTFT p50"] = first["ttft_p50_s"] if first else None
        return out

    reference = figures()
    rows = []
    for name, value in base.items():
        if name == "memory_utilization":
            moved = figures(**{name: min(0.98, value * scale)})
        else:
            moved = figures(**{name: value * scale})
        changes = {k: _change(reference[k], moved[k]) for k in reference}
        known = {k: v for k, v in changes.items() if v is not None}
        most = max(known, key=lambda k: abs(known[k])) if known else None
        if most is not None and abs(known[most]) < 0.01:
            most = "nothing (all within 1%)"
        rows.append({"parameter": name, "changes": changes, "moves_most": most})
    return {"scale": scale, "reference": reference, "rows": rows}


def _change(before: float | None, after: float | None) -> float | None:
    """Relative change; a goodput lost (no level met the target) is -100%."""
    if not before:
        return None
    return -1.0 if after is None else after / before - 1.0


def format_sensitivity(result: dict[str, Any]) -> str:
    names = list(result["reference"])
    lines = [
        f"PROJECTION sensitivity, {SENSITIVITY_GPUS} GPUs: each parameter x{result['scale']} "
        "(memory_utilization capped at 0.98), change of each figure",
        "",
        "| parameter | " + " | ".join(names) + " | moves most |",
        "| --- | " + " | ".join("---:" for _ in names) + " | --- |",
        "| (reference) | " + " | ".join(_s(result["reference"][n]) for n in names) + " | |",
    ]
    for row in result["rows"]:
        cells = ["-" if row["changes"][n] is None else f"{row['changes'][n]:+.0%}" for n in names]
        lines.append(f"| {row['parameter']} | " + " | ".join(cells) + f" | {row['moves_most']} |")
    return "\n".join(lines)
