"""`python -m bench.sim --validate`: the simulation against what was measured.

1. The CPU fleet study (docs/benchmarks.md, "Goodput at a latency target against
   data-parallel engines", one run on a 2-core VM): goodput at the target per mode and
   TTFT p50 per history bucket at 8 agents, simulated with `cpu_fleet()` (fitted on other
   measurements) and the app's placement as it ran then (`placement: static`). Each
   simulated figure is the median of `REPLAYS` replays, their arrivals jittered (a
   measured run is one interleaving of its turns), and within the band when simulated /
   measured is in [0.8, 1.2]. `--run FILE` and `--grid FILE` compare with another run,
   the engine fitted on its day's grid.
2. The published Qwen3-32B case: `bench.sim.published`.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from bench.fleet import goodput
from bench.sim import published
from bench.sim.params import Hardware, cpu_fleet
from bench.sim.reference import BUCKET_NAMES, DOCS_RUN, Reference
from bench.sim.study import run_mode, two_engines
from bench.stats import SPANS
from bench.traces import TraceShape

CPU_BAND = 0.20

REPLAYS = 7
"""Replays of each mode, each level's arrivals jittered (`bench.sim.study.jittered`): a
simulated figure is their median, and their range is printed beside it."""


def _goodput(levels: list[dict[str, Any]]) -> tuple[float, int | None]:
    """Turns/s at the target and the agents there, as the benchmark ramps: its levels up
    to the first that misses (0, None: none met)."""
    misses = [i for i, lv in enumerate(levels) if not lv["meets_slo"]]
    best = goodput(levels[: misses[0] + 1] if misses else levels)
    return (best["turns_per_s"], best["agents"]) if best else (0.0, None)


def _level(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """One level's figures over the replays: medians, and whether most met the target."""
    met = sum(lv["meets_slo"] for lv in levels)
    itl = [lv["itl_p99_s"] for lv in levels if lv["itl_p99_s"] is not None]
    return {
        "agents": levels[0]["agents"],
        "turns_per_s": statistics.median([lv["turns_per_s"] for lv in levels]),
        "ttft_p90_s": statistics.median([lv["ttft_p90_s"] for lv in levels]),
        "itl_p99_s": statistics.median(itl) if itl else None,
        "meets_slo": 2 * met > len(levels),
        "met": f"{met}/{len(levels)}",
        "engine_steps": _median_steps([lv.get("engine_steps") or {} for lv in levels]),
    }


def _median_steps(replays: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each role's step figures (`bench.fleet.step_figures`), medians over the replays."""
    out: dict[str, dict[str, float]] = {}
    for role in sorted({r for steps in replays for r in steps}):
        figures = [steps[role] for steps in replays if steps.get(role)]
        keys = {k for f in figures for k in f}
        out[role] = {
            k: statistics.median(vals)
            for k in sorted(keys)
            if (vals := [f[k] for f in figures if f.get(k) is not None])
        }
    return out


def format_steps(levels: list[dict[str, Any]]) -> str:
    """The engines' steps per level, measured / simulated (rows where the run recorded them;
    empty when it recorded none)."""
    rows = []
    for row in levels:
        for role, measured in sorted((row.get("measured_steps") or {}).items()):
            if not measured:
                continue
            sim = row["sim"]["engine_steps"].get(role) or {}
            cells = [
                _pair(measured, sim, "mean_s"),
                _pair(measured, sim, "decode_s"),
                _pair(measured, sim, "prompt_s"),
                _pair(measured, sim, "prompt_share", 1, ".2f"),
                _pair(measured, sim, "batch", 1, ".1f"),
            ]
            name = role.removesuffix("Server").lower()
            rows.append(f"| {row['mode']} | {row['sim']['agents']} | {name} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(
        [
            "Engine steps while busy (measured / simulated, the replays' medians; ms, share, sequences):",
            "",
            "| mode | agents | role | mean | decode only | with a prompt | prompt share | batch |",
            "| --- | ---: | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )


def _pair(
    measured: dict[str, Any], sim: dict[str, Any], key: str, scale: float = 1e3, fmt: str = ".1f"
) -> str:
    return " / ".join("-" if v is None else f"{v * scale:{fmt}}" for v in (measured.get(key), sim.get(key)))


def cpu_table(
    shape: TraceShape,
    hw: Hardware | None = None,
    levels_out: list[dict[str, Any]] | None = None,
    ref: Reference = DOCS_RUN,
    replays: int = REPLAYS,
    hops_out: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Rows of (mode, figure, measured, simulated, ratio, within band) against `ref`, each
    simulated figure the median of `replays` replays (1: the trace as generated, once);
    `levels_out` collects each level's simulated figures beside the measured ones."""
    hw = hw or cpu_fleet()
    seeds: list[int | None] = list(range(1, replays + 1)) if replays > 1 else [None]
    rows: list[dict[str, Any]] = []
    for mode, (good, agents) in ref.goodput.items():
        spec = two_engines(mode, hw, placement=ref.placement)
        spa = ref.sessions_per_agent
        runs = [run_mode(spec, shape, ramp=False, sessions_per_agent=spa, replay=seed) for seed in seeds]
        goods = [_goodput(run["levels"]) for run in runs]
        at = Counter(a for _, a in goods).most_common(1)[0][0]
        sim_good = statistics.median([g for g, _ in goods]) or None
        row = _row(mode, f"goodput (turns/s) [sim at {at}, measured at {agents}]", good, sim_good, CPU_BAND)
        row["replays"] = (min(g for g, _ in goods), max(g for g, _ in goods))
        rows.append(row)
        levels = [_level(list(replayed)) for replayed in zip(*(run["levels"] for run in runs), strict=True)]
        for lv in levels:
            if levels_out is not None and (mode, lv["agents"]) in ref.levels:
                levels_out.append(
                    {
                        "mode": mode,
                        "sim": lv,
                        "measured": ref.levels[(mode, lv["agents"])],
                        "measured_steps": ref.steps.get((mode, lv["agents"])),
                    }
                )
        at8 = [next(lv for lv in run["levels"] if lv["agents"] == 8) for run in runs]
        if hops_out is not None and ref.hops.get(mode):
            hops_out += _hop_rows(mode, ref.hops[mode], [lv["hops"] for lv in at8])
        for i, (name, measured) in enumerate(zip(BUCKET_NAMES, ref.ttft_p50.get(mode, ()), strict=False)):
            if measured is None:
                continue
            replayed = [lv["buckets"][name]["ttft_p50_s"] for lv in at8]
            row = _row(
                mode, f"TTFT p50 {name} at 8 agents (s)", measured, statistics.median(replayed), CPU_BAND
            )
            row["replays"] = (min(replayed), max(replayed))
            others = [run[i] for run in ref.other_runs.get(mode, ())]
            if others:
                row["runs"] = (min([measured, *others]), max([measured, *others]))
            rows.append(row)
    return rows


def _hop_rows(
    mode: str, measured: Mapping[str, Mapping[str, float | None]], replays: list[dict[str, dict]]
) -> list[dict[str, Any]]:
    """Per bucket with turns: the measured medians (`Reference.hops`) beside the simulated
    ones, each the median over the replays."""
    rows = []
    for bucket, figures in measured.items():
        if figures.get("ttft") is None:
            continue
        sim = {}
        for name in SPANS:
            values = [r[bucket][name] for r in replays if r.get(bucket, {}).get(name) is not None]
            sim[name] = statistics.median(values) if values else None
        rows.append({"mode": mode, "bucket": bucket, "measured": dict(figures), "simulated": sim})
    return rows


def format_hops(rows: list[dict[str, Any]]) -> str:
    """Where TTFT p50 goes at 8 agents, measured / simulated (empty without rows: the run
    kept no turns)."""
    if not rows:
        return ""
    lines = [
        "Where the time to first token goes at 8 agents (medians, measured / simulated; engine "
        "spans as `app.api.metrics.turn_hops` names them):",
        "",
        "| mode | history | TTFT (s) | prefill engine (s) | decode engine (s) | tokens computed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = []
        for name in SPANS:
            fmt = ".0f" if name == "computed" else ".3f"
            pair = (r["measured"].get(name), r["simulated"].get(name))
            cells.append(" / ".join("-" if v is None else f"{v:{fmt}}" for v in pair))
        lines.append(f"| {r['mode']} | {r['bucket']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(mode: str, figure: str, measured: float, simulated: float | None, band: float) -> dict[str, Any]:
    ratio = simulated / measured if simulated is not None and measured else None
    return {
        "mode": mode,
        "figure": figure,
        "measured": measured,
        "simulated": simulated,
        "ratio": ratio,
        "within": ratio is not None and abs(ratio - 1.0) <= band,
    }


def format_levels(levels: list[dict[str, Any]]) -> str:
    lines = [
        "Per level (context; measured / simulated, the replays' medians and how many met the target):",
        "",
        "| mode | agents | turns/s | TTFT p90 (s) | ITL p99 (ms) | meets target |",
        "| --- | ---: | --- | --- | --- | --- |",
    ]
    for row in levels:
        sim, (tps, p90, itl) = row["sim"], row["measured"]
        meets = tps is not None and p90 <= 2.0 and itl <= 0.05
        sim_itl = "-" if sim["itl_p99_s"] is None else f"{sim['itl_p99_s'] * 1e3:.0f}"
        met = f" ({sim['met']})" if "met" in sim else ""
        lines.append(
            f"| {row['mode']} | {sim['agents']} | {tps:.2f} / {sim['turns_per_s']:.2f} | "
            f"{p90:.2f} / {sim['ttft_p90_s']:.2f} | {itl * 1e3:.0f} / {sim_itl} | "
            f"{'yes' if meets else 'no'} / {'yes' if sim['meets_slo'] else 'no'}{met} |"
        )
    return "\n".join(lines)


def format_report(rows: list[dict[str, Any]], gpu: dict[str, Any], ref: Reference = DOCS_RUN) -> str:
    lines = [
        f"CPU fleet study ({ref.name}, placement: {ref.placement}), simulated (median of its "
        "replays) vs measured, band +-20%:",
        "",
        "| mode | figure | measured | simulated | sim/measured | within | simulated over replays | "
        "measured over runs (context) |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for r in rows:
        sim = "-" if r["simulated"] is None else f"{r['simulated']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        within = "yes" if r["within"] else "NO"
        spread = "-" if "runs" not in r else f"{r['runs'][0]:.3f}-{r['runs'][1]:.3f}"
        replays = "-" if "replays" not in r else f"{r['replays'][0]:.3f}-{r['replays'][1]:.3f}"
        lines.append(
            f"| {r['mode']} | {r['figure']} | {r['measured']:.3f} | {sim} | {ratio} | {within} | {replays} "
            f"| {spread} |"
        )
    inside = sum(r["within"] for r in rows)
    ranged = [r for r in rows if "runs" in r and r["simulated"] is not None]
    near = sum(
        r["runs"][0] * (1 - CPU_BAND) <= r["simulated"] <= r["runs"][1] * (1 + CPU_BAND) for r in ranged
    )
    lines += ["", f"{inside} of {len(rows)} figures within the band."]
    if ranged:
        lines.append(
            f"{near} of the {len(ranged)} TTFT figures measured in more than one run within +-20% of "
            "their range (context: how far this VM moves run to run)."
        )
    lines += ["", published.format_case(gpu)]
    return "\n".join(lines)


def cpu_sensitivity(shape: TraceShape, scale: float = 1.25) -> list[dict[str, Any]]:
    """Which validation figure each CPU parameter moves most: the table above with one
    parameter at `scale` times its value, as the relative change of each figure."""
    hw = cpu_fleet()
    e, link = hw.engine, hw.link
    variants = {
        "step_s": replace(hw, engine=replace(e, step_s=e.step_s * scale)),
        "token_s": replace(hw, engine=replace(e, token_s=e.token_s * scale, attn_s=e.attn_s * scale)),
        "attn_s": replace(hw, engine=replace(e, attn_s=e.attn_s * scale)),
        "decode_seq_s": replace(hw, engine=replace(e, decode_seq_s=e.decode_seq_s * scale)),
        "decode_ctx_s": replace(hw, engine=replace(e, decode_ctx_s=e.decode_ctx_s * scale)),
        "chunk_tokens": replace(hw, engine=replace(e, chunk_tokens=round(e.chunk_tokens * scale))),
        "NIXL latency": replace(hw, link=replace(link, latency_s=link.latency_s * scale)),
        "NIXL bandwidth": replace(hw, link=replace(link, bytes_per_s=link.bytes_per_s * scale)),
        "ingress_s": replace(hw, ingress_s=hw.ingress_s * scale),
        "hop_s": replace(hw, hop_s=hw.hop_s * scale),
        "store_call_s": replace(hw, store_call_s=hw.store_call_s * scale),
        "leg_s": replace(hw, leg_s=hw.leg_s * scale),
        "host CPU per turn": replace(hw, host_cpu_per_turn_s=hw.host_cpu_per_turn_s * scale),
    }

    def figures(hardware: Hardware) -> dict[tuple[str, str], float | None]:
        rows = cpu_table(shape, hardware, replays=1)
        return {(r["mode"], r["figure"].split(" [")[0]): r["simulated"] for r in rows}

    reference = figures(hw)
    out = []
    for name, moved_hw in variants.items():
        moved = figures(moved_hw)
        changes = {k: -1.0 if (m := moved[k]) is None else m / v - 1.0 for k, v in reference.items() if v}
        most = max(changes, key=lambda k: abs(changes[k]))
        out.append({"parameter": name, "figure": f"{most[0]} {most[1]}", "change": changes[most]})
    return out


def format_cpu_sensitivity(rows: list[dict[str, Any]], scale: float = 1.25) -> str:
    lines = [
        f"CPU parameters x{scale}: the validation figure each moves most",
        "",
        "| parameter | figure moved most | change |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {r['parameter']} | {r['figure']} | {r['change']:+.0%} |" for r in rows]
    return "\n".join(lines)
