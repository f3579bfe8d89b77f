"""The measured runs of the CPU fleet study the simulation is validated against
(`bench.sim.validate`): the docs' run, as constants, or any run's results file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.sim.fleet import MODES
from bench.stats import span_medians

MEASURED_GOODPUT = {"dp": (2.36, 8), "oneway": (1.14, 4), "bidir": (2.35, 8), "bidir-pd": (4.35, 16)}
"""Turns/s at the target and agents there (docs/benchmarks.md fleet study, goodput table)."""
BUCKET_NAMES = ("0-2k", "2-4k", "4-8k", "long_tool")
MEASURED_TTFT_P50 = {
    "dp": (0.135, 0.139, 0.101, 0.377),
    "oneway": (0.318, 1.671, 1.916, 1.300),
    "bidir": (0.116, 0.114, 0.103, 0.558),
    "bidir-pd": (0.159, 0.261, 0.191, 0.551),
}
"""TTFT p50 (s) at 8 agents by history bucket (docs/benchmarks.md fleet study)."""

OTHER_RUNS_TTFT_P50 = {
    "dp": ((0.136, 0.155, 0.150, 0.476), (0.153, 0.144, 0.128, 0.487), (0.166, 0.166, 0.161, 0.437)),
    "oneway": ((0.434, 1.749, 2.224, 1.870),),
    "bidir-pd": ((0.193, 0.267, 0.166, 0.437), (0.160, 0.316, 0.189, 0.469), (0.213, 0.341, 0.247, 0.504)),
}
"""The same figures in later runs of the study on another day's code (2026-12-06:
`--modes dp,oneway,bidir,bidir-pd`, `--modes dp,bidir,bidir-pd` and, in another session,
`--modes dp,bidir-pd`; one session per agent), for the modes whose turns go where they
went then (dp, oneway and bidir-pd send every turn one way; bidir's placement changed).
Context: how far one VM moves run to run, not part of the band."""

MEASURED_LEVELS = {
    ("dp", 4): (1.74, 0.340, 0.017),
    ("dp", 8): (2.36, 0.377, 0.041),
    ("dp", 16): (4.61, 0.443, 0.142),
    ("oneway", 4): (1.14, 1.679, 0.020),
    ("oneway", 8): (1.59, 2.453, 0.022),
    ("bidir", 4): (1.73, 0.276, 0.017),
    ("bidir", 8): (2.35, 0.369, 0.046),
    ("bidir", 16): (4.48, 0.408, 0.129),
    ("bidir-pd", 4): (1.68, 0.364, 0.018),
    ("bidir-pd", 8): (2.29, 0.627, 0.024),
    ("bidir-pd", 16): (4.35, 1.014, 0.036),
    ("bidir-pd", 32): (6.02, 2.597, 0.066),
}
"""(turns/s, TTFT p90 s, ITL p99 s) per mode and level (docs/benchmarks.md fleet study):
context for the table above, not part of its band."""


@dataclass(frozen=True)
class Reference:
    """One measured run of the CPU fleet study that the table compares with."""

    name: str
    goodput: Mapping[str, tuple[float, int]]
    """Per mode, turns/s at the target and the agents there."""
    ttft_p50: Mapping[str, tuple[float | None, ...]]
    """Per mode, TTFT p50 (s) at 8 agents by history bucket (`BUCKET_NAMES`)."""
    levels: Mapping[tuple[str, int], tuple[float, float, float]]
    """(turns/s, TTFT p90 s, ITL p99 s) per mode and level: context, not the band."""
    placement: str = "static"
    """The app's placement rule in that run (`transfer.placement`)."""
    other_runs: Mapping[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)
    """The same TTFT figures in other runs (context: how far the VM moves run to run)."""
    steps: Mapping[tuple[str, int], Mapping[str, Any]] = field(default_factory=dict)
    """Per mode and level, each engine role's steps (`bench.fleet.step_figures`), where
    the run recorded them."""
    hops: Mapping[str, Mapping[str, Mapping[str, float | None]]] = field(default_factory=dict)
    """Per mode and history bucket at 8 agents, the medians of TTFT, of the engines' spans
    and of the tokens computed (`bench.sim.study.hops`), where the run kept its turns."""
    sessions_per_agent: int = 1
    """Sessions a level gave each agent (`python -m bench --level-sessions`)."""


DOCS_RUN = Reference(
    "docs/benchmarks.md fleet study",
    MEASURED_GOODPUT,
    MEASURED_TTFT_P50,
    MEASURED_LEVELS,
    "static",
    OTHER_RUNS_TTFT_P50,
)


def read_reference(path: str) -> Reference:
    """A run of `python -m bench --profile fleet --modes dp,oneway,bidir,bidir-pd --out
    FILE` as the reference. Its placement rule is read from the reasons its turns were
    placed for (`busy` and `idle` are the static rule's only)."""
    with open(path) as f:
        run = json.load(f)
    goodput: dict[str, tuple[float, int]] = {}
    ttft: dict[str, tuple[float | None, ...]] = {}
    levels: dict[tuple[str, int], tuple[float, float, float]] = {}
    steps: dict[tuple[str, int], Mapping[str, Any]] = {}
    reasons: set[str] = set()
    modes = {m: r for m, r in run["modes"].items() if m in MODES}  # not dp-again, dp's twin
    for mode, result in modes.items():
        best = result.get("goodput") or {}
        goodput[mode] = (best.get("turns_per_s") or 0.0, best.get("agents") or 0)
        for lv in result["levels"]:
            levels[(mode, lv["agents"])] = (lv["turns_per_s"], lv["ttft_p90_s"], lv["itl_p99_s"])
            reasons |= set(lv.get("placements") or {})
            if lv.get("engine_steps"):
                steps[(mode, lv["agents"])] = lv["engine_steps"]
            if lv["agents"] == 8:
                ttft[mode] = tuple(lv["buckets"][name]["ttft_p50_s"] for name in BUCKET_NAMES)
    placement = "static" if reasons & {"busy", "idle"} else "priced"
    hops = {mode: _hops(result.get("records", {}).get("8") or []) for mode, result in modes.items()}
    spa = run.get("sessions_per_agent") or 1
    return Reference(path, goodput, ttft, levels, placement, steps=steps, hops=hops, sessions_per_agent=spa)


def _hops(records: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """A level's turns as `bench.sim.study.hops` summarises the simulated ones, from the
    app's timings (`app.api.metrics.turn_hops`)."""
    from app.api.metrics import turn_hops

    def figures(r: dict[str, Any]) -> dict[str, float | None]:
        spans = turn_hops(r.get("timings") or {})
        return {
            "ttft": r["ttft_s"],
            "prefill_engine": spans.get("prefill_engine"),
            "decode_engine": spans.get("decode_engine"),
            "computed": float(r["prompt_tokens"] - r["cached_tokens"]),
        }

    ok = [r for r in records if r["ok"] and r.get("ttft_s") is not None]
    return span_medians((r["prompt_tokens"], figures(r)) for r in ok)
