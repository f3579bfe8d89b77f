"""The fleet study, simulated: per mode, a warm-up session, then levels of agents until
one misses the target, figured as `bench.fleet` figures the measured study (its SLO,
levels, arrival window, history buckets and long-tool threshold are imported, not
copied).

Differences from the measured study, on purpose: inter-token latency is one sample per
engine step weighted by the streams in it (the client measures each stream's gaps,
which are these steps); TTFT is to the engine's first token plus the hops.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from bench.fleet import ARRIVAL_WINDOW_S, BUCKETS, LEVELS, LONG_TOOL_TOKENS, SLO, goodput
from bench.sim.fleet import Fleet, FleetSpec, RunResult
from bench.stats import nearest_rank
from bench.traces import Trace, TraceShape


def weighted_quantile(samples: list[tuple[float, int]], q: float) -> float | None:
    """Nearest-rank quantile of values each counted `weight` times."""
    total = sum(w for _, w in samples)
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for value, weight in sorted(samples):
        seen += weight
        if seen >= rank:
            return value
    return samples[-1][0]


def level_figures(
    run: RunResult, slo: SLO, edges: tuple[tuple[int, int], ...] = BUCKETS, long_tool: int = LONG_TOOL_TOKENS
) -> dict[str, Any]:
    """One level's figures, as `bench.fleet.level_stats` computes them from client
    records; a run stopped early (`RunResult.aborted`) misses the target."""
    ttfts = [t.ttft_s for t in run.turns]
    ttft_p90 = nearest_rank(ttfts, 0.9)
    itl_p99 = weighted_quantile(run.itl, 0.99)
    meets = (
        ttft_p90 is not None and ttft_p90 <= slo.ttft_p90_s and (itl_p99 is None or itl_p99 <= slo.itl_p99_s)
    )
    wall = run.wall_s
    return {
        "turns": len(run.turns),
        "wall_s": round(wall, 2),
        "turns_per_s": round(len(run.turns) / wall, 3) if wall else None,
        "ttft_p50_s": nearest_rank(ttfts, 0.5),
        "ttft_p90_s": ttft_p90,
        "itl_p99_s": itl_p99,
        "prompt_tokens": sum(t.prompt_tokens for t in run.turns),
        "computed_tokens": run.computed_tokens,
        "meets_slo": meets,
        "buckets": buckets(run, edges, long_tool),
        "routes": _routes(run),
        "peak_pinned_blocks": run.peak_pinned_blocks,
        "store_calls_per_s": round(run.store_calls / wall, 1) if wall else 0.0,
    }


def buckets(
    run: RunResult, edges: tuple[tuple[int, int], ...] = BUCKETS, long_tool: int = LONG_TOOL_TOKENS
) -> dict[str, Any]:
    """TTFT p50 per history bucket and for turns with long tool results (`bench.fleet.buckets`)."""
    out: dict[str, Any] = {}
    for low, high in edges:
        group = [t.ttft_s for t in run.turns if low <= t.prompt_tokens < high]
        name = f"{low // 1000}k+" if high >= 1 << 30 else f"{low // 1000}-{high // 1000}k"
        out[name] = {"turns": len(group), "ttft_p50_s": nearest_rank(group, 0.5)}
    long = [t.ttft_s for t in run.turns if t.kind == "tool" and t.tokens >= long_tool]
    out["long_tool"] = {"turns": len(long), "ttft_p50_s": nearest_rank(long, 0.5)}
    return out


def _routes(run: RunResult) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in run.turns:
        out[t.route] = out.get(t.route, 0) + 1
    return out


def warmup_trace(shape: TraceShape) -> Trace:
    """The benchmark's warm-up: one session of three turns (`bench.fleet.run_mode`)."""
    return replace(shape, sessions=1, turns_median=3, turns_max=3).generate().renamed("warmup/")


def level_trace(shape: TraceShape, agents: int) -> Trace:
    """A level's agents arriving within `ARRIVAL_WINDOW_S` (`bench.fleet.run_mode`), with
    session ids of their own: like the benchmark's levels, they find nothing of another
    level's (or the warm-up's) in the caches or the store."""
    trace = replace(shape, sessions=agents, arrival_rate_per_s=agents / ARRIVAL_WINDOW_S).generate()
    return trace.renamed(f"level{agents}/")


def run_mode(
    spec: FleetSpec,
    shape: TraceShape,
    levels: tuple[int, ...] = LEVELS["fleet"],
    slo: SLO | None = None,
    ramp: bool = True,
) -> dict[str, Any]:
    """One mode through the levels on one fleet (after a warm-up), stopping after the
    first level that misses the target when `ramp` (as the benchmark does)."""
    slo = slo or SLO()
    fleet = Fleet(spec)
    fleet.run(warmup_trace(shape))
    out = []
    for agents in levels:
        figures = {"agents": agents, **level_figures(fleet.run(level_trace(shape, agents)), slo)}
        out.append(figures)
        if ramp and not figures["meets_slo"]:
            break
    return {"mode": spec.mode, "levels": out, "goodput": goodput(out)}
