"""The engines' step wait in the fleet (`Hardware.step_wait_s`, `step_wait_nixl_s`), fitted
on one run of the fleet study: `python -m bench.sim --validate --steps FILE`.

An engine alone (the grid) steps in its compute time. In the fleet its decode steps take
longer: each step hands its batch from the engine core to the worker and back between
processes, and on cores shared with the other engine and the serving processes a woken
process waits its turn, a wait that does not grow with the step's compute; the P/D
engines' NixlConnector adds its own work each step. The app's replicas count their engines'
steps (`PromptTokenCounts.busy_step`), the study prints them per role and level, and the
simulated engines count theirs alike (`EngineStats.loaded_steps`). The wait is the
measured steps that only decoded, less the simulated ones at no wait on the same grid:
the median over the levels of dp's engines (no connector) and of the P/D modes' decode
engines. Fit it on one run and validate on another (`--run`), both beside their day's
grid (`--grid`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from bench.sim.params import Hardware
from bench.sim.reference import read_reference
from bench.sim.study import run_mode, two_engines
from bench.traces import TraceShape

FIT_REPLAYS = 3
"""Replays of each mode the fit takes its simulated steps from (their median)."""


@dataclass(frozen=True)
class StepWaits:
    plain_s: float
    """dp's engines (no NixlConnector)."""
    nixl_s: float
    """The P/D modes' engines."""
    rows: tuple[dict[str, Any], ...]
    """Per mode and level: the measured and simulated decode-only step it was fitted on."""
    source: str

    def apply(self, hw: Hardware) -> Hardware:
        return replace(hw, step_wait_s=self.plain_s, step_wait_nixl_s=self.nixl_s)


def fit(path: str, shape: TraceShape, hw: Hardware, replays: int = FIT_REPLAYS) -> StepWaits:
    """The waits that bring the simulated decode-only steps of `path`'s modes to the
    measured ones (`hw` as it comes, its waits set to none)."""
    ref = read_reference(path)
    hw = replace(hw, step_wait_s=0.0, step_wait_nixl_s=0.0)
    rows: list[dict[str, Any]] = []
    for mode in ref.goodput:
        measured_levels = {a: s for (m, a), s in ref.steps.items() if m == mode}
        if not measured_levels:
            continue
        spec = two_engines(mode, hw, placement=ref.placement)
        runs = [run_mode(spec, shape, ramp=False, replay=seed) for seed in range(1, replays + 1)]
        for levels in zip(*(run["levels"] for run in runs), strict=True):
            agents = levels[0]["agents"]
            measured = (measured_levels.get(agents) or {}).get("DecodeServer") or {}
            simulated = [(lv["engine_steps"].get("DecodeServer") or {}).get("decode_s") for lv in levels]
            if measured.get("decode_s") and all(simulated):
                sim = statistics.median(s for s in simulated if s)
                rows.append(
                    {"mode": mode, "agents": agents, "measured_s": measured["decode_s"], "sim_s": sim}
                )
    plain = [r["measured_s"] - r["sim_s"] for r in rows if r["mode"] == "dp"]
    nixl = [r["measured_s"] - r["sim_s"] for r in rows if r["mode"] != "dp"]
    if not plain or not nixl:
        raise ValueError(f"{path}: no decode steps recorded for dp and a P/D mode (bench --profile fleet)")
    return StepWaits(max(0.0, statistics.median(plain)), max(0.0, statistics.median(nixl)), tuple(rows), path)


def format_fit(waits: StepWaits) -> str:
    lines = [
        f"Step waits fitted on {waits.source}: dp's engines {waits.plain_s * 1e3:.1f} ms, "
        f"the P/D engines {waits.nixl_s * 1e3:.1f} ms (decode-only steps, measured / simulated at no wait):",
        "",
        "| mode | agents | measured (ms) | simulated (ms) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in waits.rows:
        lines.append(
            f"| {r['mode']} | {r['agents']} | {r['measured_s'] * 1e3:.1f} | {r['sim_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)
