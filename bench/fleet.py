"""`python -m bench --profile fleet --modes dp,oneway,bidir`: goodput at a latency target.

Per mode: deploy once, warm up, then ramp the number of concurrent agents through
`LEVELS` (4-32 on CPU, 4-64 with `fleet-gpu`, to `--max-agents`) until a level misses.
Each level runs a fresh trace of that many agents (`bench.traces`, the profile's shape;
its own system prompts, so levels do not share cache) to its end (`--level-sessions K`:
K sessions per agent, that many agents at once, for more turns a level), with the engines'
counters read around it. A level *meets the target* when its TTFT p90 is within
`SLO.ttft_p90_s` and its inter-token latency p99 within `SLO.itl_p99_s`. A mode's
goodput is the highest rate of turns (turns per second of the level's wall time) at a
level that meets the target, and the number of agents there.

Reported per mode and level: turns/s, TTFT p50/p90, ITL p99, whether the target holds,
prompt tokens computed by the engines, CPU seconds by process role (`bench.hostcpu`);
per mode, TTFT by history bucket and for turns carrying long tool results
(`LONG_TOOL_TOKENS`); ratios bidir/dp and bidir/oneway, and bidir's turns against their
twins in dp by placement (`bench.paired`). A PNG plots turns/s, TTFT p90 and ITL p99
against agents.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.client import kv_stats, run_workload, served_model
from bench.deploy import LocalCluster, deployed
from bench.hostcpu import ROLES, cpu_by_role, spent
from bench.paired import tables as paired_tables
from bench.profiles import Profile
from bench.record import TurnRecord
from bench.stats import BUCKETS, bucket_name, nearest_rank, ratio, share_over
from bench.traces import to_workload
from bench.workload import TokenCounter, Workload

LEVELS = {"fleet": (4, 8, 16, 32), "fleet-32k": (4, 8, 16), "fleet-gpu": (4, 8, 16, 32, 64)}
"""Concurrent agents per level, in order, by profile. A mode's ramp stops after the
first level that misses the target (its goodput is known by then)."""
ARRIVAL_WINDOW_S = 5.0
"""A level's agents arrive (Poisson) over about this long: the level is their number
running at once, not an arrival rate."""
LONG_TOOL_TOKENS = 1000
"""A turn whose tool result is at least this long counts as a long tool result."""


def ramp(profile: str, max_agents: int | None = None) -> tuple[int, ...]:
    """The levels a mode runs: the profile's `LEVELS` to `max_agents` (`--max-agents`), the first always."""
    return tuple(n for i, n in enumerate(LEVELS[profile]) if i == 0 or max_agents is None or n <= max_agents)


@dataclass(frozen=True)
class SLO:
    """The latency target of an interactive agent: 90% of turns start answering within
    2 s, and 99% of tokens stream at 20 tokens/s or faster (50 ms apart)."""

    ttft_p90_s: float = 2.0
    itl_p99_s: float = 0.05


def level_stats(records: list[TurnRecord], wall_s: float, slo: SLO) -> dict[str, Any]:
    """One level's figures and whether it meets `slo`."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    ttft_p90, itl_p99 = nearest_rank(ttfts, 0.9), nearest_rank(itls, 0.99)
    errors = len(records) - len(ok)
    meets = (
        errors == 0
        and ttft_p90 is not None
        and ttft_p90 <= slo.ttft_p90_s
        and (itl_p99 is None or itl_p99 <= slo.itl_p99_s)
    )
    return {
        "turns": len(ok),
        "errors": errors,
        "wall_s": round(wall_s, 2),
        "turns_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "ttft_p50_s": nearest_rank(ttfts, 0.5),
        "ttft_p90_s": ttft_p90,
        "itl_p99_s": itl_p99,
        "itl_late_share": share_over(itls, slo.itl_p99_s),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "meets_slo": meets,
    }


def busy_steps(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """A role's engine steps while busy over a level, from its replicas' counters."""
    from bench.runner import counter_delta

    added = counter_delta(after, before) if before else None
    return step_figures(added) if added else None


def step_figures(added: dict[str, Any]) -> dict[str, Any] | None:
    """From an engine role's step counters over a level (`engine_busy_steps` and its
    siblings, as `bench.runner.COUNTERS` names them): its mean step, its mean step that
    only decoded and its mean step that computed a prompt (seconds), the share of the
    latter, and the mean batch. The simulation's engines report the same counters."""
    steps, prompts = added["engine_busy_steps"], added["engine_prompt_steps"]
    if steps <= 0:
        return None
    total, prompt_s = added["engine_busy_step_s"], added["engine_prompt_step_s"]
    return {
        "mean_s": round(total / steps, 5),
        "decode_s": round((total - prompt_s) / (steps - prompts), 5) if steps > prompts else None,
        "prompt_s": round(prompt_s / prompts, 5) if prompts else None,
        "prompt_share": round(prompts / steps, 3),
        "batch": round(added["engine_busy_step_seqs"] / steps, 2),
    }


def goodput(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The level with the highest turns/s among those that meet the target."""
    meeting = [lv for lv in levels if lv["meets_slo"] and lv["turns_per_s"]]
    if not meeting:
        return None
    best = max(meeting, key=lambda lv: lv["turns_per_s"])
    return {"agents": best["agents"], "turns_per_s": best["turns_per_s"]}


def buckets(records: list[TurnRecord], long_tools: set[tuple[int, int]]) -> dict[str, Any]:
    """TTFT p50/p90 per history bucket, and for turns with long tool results."""
    ok = [(r, r.ttft_s) for r in records if r.ok and r.ttft_s is not None]
    out: dict[str, Any] = {}
    for low, high in BUCKETS:
        group = [ttft for r, ttft in ok if low <= (r.prompt_tokens or 0) < high]
        out[bucket_name(low, high)] = {
            "turns": len(group),
            "ttft_p50_s": nearest_rank(group, 0.5),
            "ttft_p90_s": nearest_rank(group, 0.9),
        }
    long = [ttft for r, ttft in ok if (r.session, r.turn) in long_tools]
    out["long_tool"] = {
        "turns": len(long),
        "ttft_p50_s": nearest_rank(long, 0.5),
        "ttft_p90_s": nearest_rank(long, 0.9),
    }
    return out


def _long_tool_turns(workload: Workload) -> set[tuple[int, int]]:
    return {
        (p.index, i + 1)
        for p in workload.sessions
        for i, t in enumerate(p.turns)
        if t.kind == "tool" and t.tokens >= LONG_TOOL_TOKENS
    }


def run_mode(
    cluster: LocalCluster,
    prof: Profile,
    mode: str,
    model_path: str,
    counter: TokenCounter,
    slo: SLO,
    log,
    sessions_per_agent: int,
    levels: tuple[int, ...],  # `ramp`
) -> dict:
    from bench.runner import engine_counters

    assert prof.trace is not None
    app = f"fleet-{mode}"
    cfg = prof.app_config(mode, model_path, app)
    log(f"[{mode}] deploying")
    measured: list[dict[str, Any]] = []
    records_by_level: dict[int, list[dict]] = {}
    with deployed(cfg, cluster=cluster, name=app, health_timeout_s=300.0) as dep:
        url, deploy_s = dep.url, dep.deploy_s
        model = asyncio.run(served_model(url))
        warm = to_workload(
            replace(prof.trace, sessions=1, turns_median=3, turns_max=3).generate(), counter, tag="warm"
        )
        asyncio.run(run_workload(url, model, warm, session_prefix=f"warm-{uuid.uuid4().hex[:6]}"))
        roles = ("PrefillServer", "DecodeServer") if cfg.disaggregated else ("DecodeServer",)
        for agents in levels:
            shape = replace(
                prof.trace, sessions=agents * sessions_per_agent, arrival_rate_per_s=agents / ARRIVAL_WINDOW_S
            )
            workload = to_workload(shape.generate(), counter, tag=f"L{agents}")
            # At most `agents` sessions at once: a later one starts as one ends.
            workload = replace(workload, spec=replace(workload.spec, concurrency=agents))
            before = {r: engine_counters(app, r) for r in roles}
            cpu_before = cpu_by_role()
            log(f"[{mode}] {agents} agents")
            records, wall = asyncio.run(
                run_workload(url, model, workload, session_prefix=f"{mode}-L{agents}-{uuid.uuid4().hex[:6]}")
            )
            cpu = cpu_by_role()
            time.sleep(1.0)
            after = {r: engine_counters(app, r) for r in roles}
            long_tools = _long_tool_turns(workload)
            computed = sum(
                (after[r] or {}).get("prompt_tokens_computed", 0)
                - (before[r] or {}).get("prompt_tokens_computed", 0)
                for r in roles
            )
            level = {
                "agents": agents,
                **level_stats(records, wall, slo),
                "engine_tokens_computed": computed,
                "engine_steps": {r: busy_steps(before[r], after[r]) for r in roles},
                "buckets": buckets(records, long_tools),
                "long_tool_hops": long_tool_hops(records, long_tools),
                "placements": placements(records),
                "long_tools": sorted(long_tools),
                "cpu_s": spent(cpu_before, cpu, sum(1 for r in records if r.ok)),
            }
            measured.append(level)
            log(f"[{mode}] {agents} agents: {level}")
            records_by_level[agents] = [r.as_dict() for r in records]
            if not level["meets_slo"]:
                break
        kv = asyncio.run(kv_stats(url))
    return {
        "mode": mode,
        "deploy_s": round(deploy_s, 1),
        "levels": measured,
        "goodput": goodput(measured),
        "kv_turns": (kv or {}).get("turns"),
        "records": records_by_level,
    }


def ratios(modes: dict[str, dict]) -> dict[str, Any]:
    """Each bidir mode against dp (and dp deployed again, `dp-again`) and oneway: goodput,
    ITL p99 and TTFT p50 per history bucket at the highest level both ran, and TTFT p50 and
    p90 per bucket at the highest level both met the target (`..._met`)."""
    out: dict[str, Any] = {}
    for mine in ("bidir", "bidir-host", "bidir-pd", "dp-again"):
        run_b = modes.get(mine)
        if run_b is None:
            continue
        for other in ("dp", "dp-again", "oneway"):
            run = modes.get(other) if other != mine else None
            if run is None:
                continue
            g_b, g_o = run_b["goodput"], run["goodput"]
            out[f"goodput_{mine}_over_{other}"] = ratio(
                g_b and g_b["turns_per_s"], g_o and g_o["turns_per_s"]
            )
            both = {lv["agents"] for lv in run_b["levels"]} & {lv["agents"] for lv in run["levels"]}
            if not both:
                continue
            common = max(both)
            b = next(lv for lv in run_b["levels"] if lv["agents"] == common)
            o = next(lv for lv in run["levels"] if lv["agents"] == common)
            out[f"itl_p99_{mine}_over_{other}_at_{common}"] = ratio(b["itl_p99_s"], o["itl_p99_s"])
            out[f"ttft_p50_{mine}_over_{other}_by_bucket_at_{common}"] = {
                name: ratio(v["ttft_p50_s"], o["buckets"][name]["ttft_p50_s"])
                for name, v in b["buckets"].items()
            }
            met = [lv["agents"] for lv in run_b["levels"] if lv["meets_slo"] and lv["agents"] in both]
            met = [a for a in met if next(lv for lv in run["levels"] if lv["agents"] == a)["meets_slo"]]
            if met:
                b = next(lv for lv in run_b["levels"] if lv["agents"] == max(met))
                o = next(lv for lv in run["levels"] if lv["agents"] == max(met))
                for q in ("p50", "p90"):
                    out[f"ttft_{q}_{mine}_over_{other}_by_bucket_at_{max(met)}_met"] = {
                        name: ratio(v[f"ttft_{q}_s"], o["buckets"][name][f"ttft_{q}_s"])
                        for name, v in b["buckets"].items()
                    }
    return out


def long_tool_hops(records: list[TurnRecord], long_tools: set[tuple[int, int]]) -> dict[str, Any]:
    """Where the time to first token of the turns with long tool results went, by where
    they were computed (`decode`: on the session's decode engine or a single engine;
    `prefill`: through prefill): their number, and the medians of TTFT and of each hop
    (`app.api.metrics.turn_hops`)."""
    from app.api.metrics import turn_hops

    out: dict[str, Any] = {}
    for r in records:
        if not r.ok or r.ttft_s is None or (r.session, r.turn) not in long_tools:
            continue
        route = "prefill" if "prefill_s" in (r.timings or {}) else "decode"
        group = out.setdefault(route, {"turns": 0, "ttft_s": [], "hops": {}})
        group["turns"] += 1
        group["ttft_s"].append(r.ttft_s)
        for hop, seconds in turn_hops(r.timings or {}).items():
            group["hops"].setdefault(hop, []).append(seconds)
    for group in out.values():
        group["ttft_s"] = nearest_rank(group["ttft_s"], 0.5)
        group["hops"] = {hop: nearest_rank(v, 0.5) for hop, v in group["hops"].items()}
    return out


def placements(records: list[TurnRecord]) -> dict[str, int]:
    """The app's placement reasons (`kvturn.placement`) of a level's turns, counted."""
    counts: dict[str, int] = {}
    for r in records:
        if r.placement:
            counts[r.placement] = counts.get(r.placement, 0) + 1
    return dict(sorted(counts.items()))


def markdown(results: dict) -> str:
    def f(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    slo = results["slo"]
    lines = [
        f"Target: TTFT p90 <= {slo['ttft_p90_s']} s and ITL p99 <= {slo['itl_p99_s']} s.",
        "",
        "| mode | agents | turns/s | TTFT p50 | TTFT p90 | ITL p99 | past ITL target "
        "| meets target | computed | errors |",
        "|" + " --- |" * 10,
    ]
    for mode, run in results["modes"].items():
        for lv in run["levels"]:
            row = (
                mode,
                str(lv["agents"]),
                f(lv["turns_per_s"]),
                f(lv["ttft_p50_s"]),
                f(lv["ttft_p90_s"]),
                f(lv["itl_p99_s"]),
                "-" if lv.get("itl_late_share") is None else f"{100 * lv['itl_late_share']:.2f}%",
                "yes" if lv["meets_slo"] else "no",
                str(lv["engine_tokens_computed"]),
                str(lv["errors"]),
            )
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| mode | goodput (turns/s) | at agents |", "| --- | --- | --- |"]
    for mode, run in results["modes"].items():
        g = run["goodput"] or {}
        lines.append(f"| {mode} | {f(g.get('turns_per_s'))} | {f(g.get('agents'))} |")
    # TTFT by history bucket at the highest level every mode ran (same load for all).
    common = min(
        (max(lv["agents"] for lv in run["levels"]) for run in results["modes"].values()), default=None
    )
    if common is not None:
        at = {
            m: next(lv for lv in run["levels"] if lv["agents"] == common)
            for m, run in results["modes"].items()
        }
        names = list(next(iter(at.values()))["buckets"])
        lines += [
            "",
            f"TTFT p50 (s) by history at {common} agents:",
            "",
            "| mode | " + " | ".join(names) + " |",
            "|" + " --- |" * (len(names) + 1),
        ]
        for mode, lv in at.items():
            lines.append(f"| {mode} | " + " | ".join(f(lv["buckets"][n]["ttft_p50_s"]) for n in names) + " |")
        lines += [
            "",
            f"Turns with long tool results at {common} agents, medians (s):",
            "",
            "| mode | computed | turns | TTFT | hops |",
            "| --- | --- | --- | --- | --- |",
        ]
        for mode, lv in at.items():
            for route, g in sorted(lv.get("long_tool_hops", {}).items()):
                hops = ", ".join(f"{h} {f(v)}" for h, v in g["hops"].items())
                lines.append(f"| {mode} | {route} | {g['turns']} | {f(g['ttft_s'])} | {hops} |")
    cpu_rows = [
        (mode, lv["agents"], lv["cpu_s"])
        for mode, run in results["modes"].items()
        for lv in run["levels"]
        if lv.get("cpu_s")
    ]
    if cpu_rows:
        lines += [
            "",
            "CPU seconds per level by role, and the serving processes' per turn (`bench.hostcpu`):",
            "",
            "| mode | agents | " + " | ".join(ROLES) + " | host per turn |",
            "|" + " --- |" * (len(ROLES) + 3),
        ]
        for mode, agents, cpu in cpu_rows:
            cells = " | ".join(f(cpu.get(r), 1) for r in ROLES)
            lines.append(f"| {mode} | {agents} | {cells} | {f(cpu.get('host_per_turn_s'))} |")
    for mode, run in results["modes"].items():
        for lv in run["levels"]:
            if lv.get("placements"):
                lines.append(f"\n{mode} at {lv['agents']} agents, placements: {lv['placements']}")
    lines += paired_tables(results)
    lines += ["", "Ratios: " + json.dumps(results["ratios"])]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for mode, run in results["modes"].items():
        agents = [lv["agents"] for lv in run["levels"]]
        a.plot(agents, [lv["turns_per_s"] for lv in run["levels"]], marker="o", label=mode)
        for lv in run["levels"]:
            if not lv["meets_slo"]:
                a.plot([lv["agents"]], [lv["turns_per_s"]], marker="x", color="black")
        b.plot(agents, [lv["ttft_p90_s"] for lv in run["levels"]], marker="o", label=mode)
        c.plot(agents, [lv["itl_p99_s"] for lv in run["levels"]], marker="o", label=mode)
    b.axhline(results["slo"]["ttft_p90_s"], color="grey", linestyle="--", label="target")
    c.axhline(results["slo"]["itl_p99_s"], color="grey", linestyle="--", label="target")
    a.set(xlabel="concurrent agents", ylabel="turns / s (x: misses the target)", title="Throughput")
    b.set(xlabel="concurrent agents", ylabel="TTFT p90 (s)", title="TTFT p90")
    c.set(xlabel="concurrent agents", ylabel="ITL p99 (s)", title="Inter-token latency p99")
    for ax in (a, b, c):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(args, prof: Profile, model_path: str, modes: list[str], log) -> int:
    from bench.profiles import cluster_cpus

    slo = SLO()
    counter = TokenCounter(model_path)
    started = time.perf_counter()
    runs: dict[str, dict] = {}
    per_agent, levels = getattr(args, "level_sessions", 1), ramp(prof.name, getattr(args, "max_agents", None))
    with LocalCluster(args.port, prof.env, num_cpus=cluster_cpus()) as cluster:
        for mode in modes:
            runs[mode] = run_mode(cluster, prof, mode, model_path, counter, slo, log, per_agent, levels)
    results = {
        "profile": prof.name,
        "slo": asdict(slo),
        "levels": list(levels),
        "sessions_per_agent": per_agent,
        "trace": asdict(prof.trace) if prof.trace else None,
        "modes": runs,
        "ratios": ratios(runs),
        "duration_s": round(time.perf_counter() - started, 1),
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    png = None if args.no_plot else plot(results, out.with_suffix(".png"))
    print(markdown(results) + f"\n\nresults: {out}" + (f"\nplot: {png}" if png else ""))
    print(f"total time: {results['duration_s']:.0f} s")
    return 1 if any(lv["errors"] for run in runs.values() for lv in run["levels"]) else 0
