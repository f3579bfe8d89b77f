"""The fleet study, simulated: per mode, a warm-up session, then levels of agents until
one misses the target, figured as `bench.fleet` figures the measured study (its SLO,
levels, arrival window, history buckets and long-tool threshold are imported, not
copied).

Differences from the measured study, on purpose: inter-token latency is one sample per
engine step weighted by the streams in it (the client measures each stream's gaps,
which are these steps); TTFT is to the engine's first token plus the hops.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from bench.fleet import ARRIVAL_WINDOW_S, LEVELS, LONG_TOOL_TOKENS, SLO, goodput
from bench.sim.fleet import Fleet, FleetSpec, RunResult
from bench.sim.params import Hardware
from bench.stats import BUCKETS, bucket_name, nearest_rank, span_medians
from bench.traces import Trace, TraceShape


def weighted_quantile(samples: list[tuple[float, float]], q: float) -> float | None:
    """Nearest-rank quantile of values each counted `weight` times (weights may be
    fractional: the smallest value whose cumulative weight reaches `q` of the total)."""
    total = sum(w for _, w in samples)
    if not total:
        return None
    rank = q * total * (1 - 1e-12)  # float sums of fractional weights fall a hair short
    seen = 0.0
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
        "hops": hops(run, edges),
        "routes": _routes(run),
        "placements": run.placements,
        "peak_pinned_blocks": run.peak_pinned_blocks,
        "store_calls_per_s": round(run.store_calls / wall, 1) if wall else 0.0,
        "engine_steps": run.engine_steps,
    }


def buckets(
    run: RunResult, edges: tuple[tuple[int, int], ...] = BUCKETS, long_tool: int = LONG_TOOL_TOKENS
) -> dict[str, Any]:
    """TTFT p50 and p90 per history bucket and for turns with long tool results (`bench.fleet.buckets`)."""
    out: dict[str, Any] = {}
    for low, high in edges:
        group = [t.ttft_s for t in run.turns if low <= t.prompt_tokens < high]
        out[bucket_name(low, high)] = _ttfts(group)
    out["long_tool"] = _ttfts([t.ttft_s for t in run.turns if t.kind == "tool" and t.tokens >= long_tool])
    return out


def hops(run: RunResult, edges: tuple[tuple[int, int], ...] = BUCKETS) -> dict[str, dict[str, float | None]]:
    """Per history bucket, the medians of the turns' TTFT and of their engines' spans, as
    the app's `turn_hops` names them (`prefill_engine` over the turns that had a prefill
    leg; `decode_engine`: the engine that streamed the answer), and the turns' new tokens
    (`bench.stats.span_medians`, as `bench.sim.reference` reads a measured run)."""
    figures = (
        (
            t.prompt_tokens,
            {
                "ttft": t.ttft_s,
                "prefill_engine": t.prefill_s,
                "decode_engine": t.engine_s,
                "computed": float(t.computed_tokens),
            },
        )
        for t in run.turns
    )
    return span_medians(figures, edges)


def _ttfts(group: list[float]) -> dict[str, Any]:
    return {
        "turns": len(group),
        "ttft_p50_s": nearest_rank(group, 0.5),
        "ttft_p90_s": nearest_rank(group, 0.9),
    }


def _routes(run: RunResult) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in run.turns:
        out[t.route] = out.get(t.route, 0) + 1
    return out


def warmup_trace(shape: TraceShape) -> Trace:
    """The benchmark's warm-up: one session of three turns (`bench.fleet.run_mode`)."""
    return replace(shape, sessions=1, turns_median=3, turns_max=3).generate().renamed("warmup/")


def level_trace(shape: TraceShape, agents: int, sessions_per_agent: int = 1) -> Trace:
    """A level's sessions (`sessions_per_agent` per agent) arriving at `agents` per
    `ARRIVAL_WINDOW_S` (`bench.fleet.run_mode`), with session ids of their own: like the
    benchmark's levels, they find nothing of another level's (or the warm-up's) in the
    caches or the store. Run them `agents` at a time, as the benchmark does."""
    sessions = agents * sessions_per_agent
    trace = replace(shape, sessions=sessions, arrival_rate_per_s=agents / ARRIVAL_WINDOW_S).generate()
    return trace.renamed(f"level{agents}/")


REPLAY_JITTER_S = 0.05
"""How far a replay moves each session's arrival, either way (`jittered`)."""


def jittered(trace: Trace, seed: int, spread_s: float = REPLAY_JITTER_S) -> Trace:
    """`trace` with each session's arrival moved by up to `spread_s` either way (seeded):
    the same workload, its turns interleaved a little differently. A measured run is one
    such interleaving; the simulation's figures move with it as the measured ones do from
    run to run, so a figure is best read over several replays."""
    rng = random.Random(seed)
    sessions = (
        replace(s, start_s=max(0.0, s.start_s + rng.uniform(-spread_s, spread_s))) for s in trace.sessions
    )
    return replace(trace, sessions=tuple(sessions))


def run_mode(
    spec: FleetSpec,
    shape: TraceShape,
    levels: tuple[int, ...] = LEVELS["fleet"],
    slo: SLO | None = None,
    ramp: bool = True,
    sessions_per_agent: int = 1,
    replay: int | None = None,
) -> dict[str, Any]:
    """One mode through the levels on one fleet (after a warm-up), stopping after the
    first level that misses the target when `ramp` (as the benchmark does); `replay`:
    each level's arrivals `jittered` by that seed (None: as generated)."""
    slo = slo or SLO()
    fleet = Fleet(spec)
    fleet.run(warmup_trace(shape))
    out = []
    for agents in levels:
        trace = level_trace(shape, agents, sessions_per_agent)
        if replay is not None:
            trace = jittered(trace, replay * 1000 + agents)
        run = fleet.run(trace, concurrency=agents)
        figures = {"agents": agents, **level_figures(run, slo)}
        out.append(figures)
        if ramp and not figures["meets_slo"]:
            break
    return {"mode": spec.mode, "levels": out, "goodput": goodput(out)}


def two_engines(mode: str, hw: Hardware, **spec: Any) -> FleetSpec:
    """The CPU fleet study's layout of `mode`: dp on two engines, the P/D modes on one
    prefill and one decode engine."""
    return FleetSpec(mode, hw, decode=2 if mode == "dp" else 1, **spec)


STUDY_MODES = ("dp", "bidir", "bidir-host", "bidir-pd")
"""`python -m bench.sim --study`: the modes of the measured runs it is read beside."""


def compare(
    hw: Hardware,
    shape: TraceShape,
    sessions_per_agent: int = 1,
    levels: tuple[int, ...] = LEVELS["fleet"],
    transfer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fleet study's `--modes dp,bidir,bidir-pd` on `hw`, simulated: dp on two engines,
    the app's default placement (`bidir`, with `transfer` settings changed) and every turn
    through prefill (`bidir-pd`) on one prefill and one decode engine, each ramped through
    `levels` until one misses the target."""
    changed = tuple(sorted((transfer or {}).items()))
    return {
        mode: run_mode(
            two_engines(mode, hw, transfer=changed),
            shape,
            levels,
            sessions_per_agent=sessions_per_agent,
        )
        for mode in STUDY_MODES
    }


def default_over_dp(result: dict[str, Any], mode: str = "bidir") -> list[dict[str, Any]]:
    """At each level both dp and `mode` (the default) meet the target: its TTFT p50 and
    p90 over dp's, per history bucket (None where a bucket is empty)."""
    meets = {m: {lv["agents"]: lv for lv in result[m]["levels"] if lv["meets_slo"]} for m in ("dp", mode)}
    rows = []
    for agents in sorted(set(meets["dp"]) & set(meets[mode])):
        dp, default = meets["dp"][agents]["buckets"], meets[mode][agents]["buckets"]
        row: dict[str, Any] = {"agents": agents}
        for name, ours in default.items():
            for q in ("ttft_p50_s", "ttft_p90_s"):
                a, b = ours[q], dp[name][q]
                row[f"{name} {q[5:8]}"] = round(a / b, 2) if a and b else None
        rows.append(row)
    return rows


def format_compare(result: dict[str, Any]) -> str:
    lines = [
        "| mode | agents | turns/s | TTFT p90 (s) | ITL p99 (ms) | meets target | turns by route "
        "| placed by reason |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for mode, run in result.items():
        for lv in run["levels"]:
            itl = f"{lv['itl_p99_s'] * 1e3:.0f}" if lv["itl_p99_s"] is not None else "-"
            routes = ", ".join(f"{k} {v}" for k, v in sorted(lv["routes"].items()))
            placed = ", ".join(f"{k} {v}" for k, v in lv["placements"].items()) or "-"
            lines.append(
                f"| {mode} | {lv['agents']} | {lv['turns_per_s']:.2f} | {lv['ttft_p90_s']:.2f} | {itl} | "
                f"{'yes' if lv['meets_slo'] else 'no'} | {routes} | {placed} |"
            )
    good = {m: (r["goodput"] or {}).get("turns_per_s") for m, r in result.items()}
    lines.append("\ngoodput (turns/s): " + ", ".join(f"{m} {g}" for m, g in good.items()))
    for mode in ("bidir", "bidir-host"):
        rows = default_over_dp(result, mode) if mode in result else []
        if not rows:
            continue
        names = [k for k in rows[0] if k != "agents" and any(row[k] is not None for row in rows)]
        lines += [
            f"\n{mode} over dp, at each level both meet:\n",
            "| agents | " + " | ".join(names) + " |",
        ]
        lines.append("| ---: |" + " ---: |" * len(names))
        for row in rows:
            cells = ["-" if row[k] is None else f"{row[k]:.2f}" for k in names]
            lines.append(f"| {row['agents']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
