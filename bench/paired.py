"""Turn by turn: where one mode's time to first token goes against another's.

The fleet study runs the same trace in every mode (`bench.fleet`: each level's agents,
sessions and prompts are the same), so each turn of one mode has a twin in another, with
the same prompt. `by_reason` pairs the twins of one level and groups them by where the
app placed the turn (`kvturn.placement`: `short`, `sooner`, `itl`, ...), per history
bucket: how many, the median of their TTFT over their twins', both medians, and the
median of the tokens the engines computed for them. A bucket's TTFT p50 in
`bench.fleet.ratios` is taken over all of these groups' turns; this says which moves it.

    python -m bench.paired results/fleet.json [--mode bidir] [--base dp] [--agents 4]

Without `--agents`: the highest level both modes met the target at.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

from bench.stats import BUCKETS, bucket_name


def _bucket(prompt_tokens: int) -> str:
    return next(bucket_name(low, high) for low, high in BUCKETS if low <= prompt_tokens < high)


def highest_met(results: dict[str, Any], mode: str, base: str) -> int | None:
    """The most agents at which both modes met the target (None: no such level)."""
    met = [{lv["agents"] for lv in results["modes"][m]["levels"] if lv["meets_slo"]} for m in (mode, base)]
    both = met[0] & met[1]
    return max(both) if both else None


def by_reason(records: Sequence[dict[str, Any]], twins: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of (bucket, reason): `records` (one mode's turns at a level) against `twins`
    (another mode's, the same level), paired by session and turn. Turns that failed in
    either, or whose prompts differ, are left out."""
    other = {(t["session"], t["turn"]): t for t in twins if t["ok"] and t.get("ttft_s")}
    groups: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for t in records:
        twin = other.get((t["session"], t["turn"]))
        if not t["ok"] or not t.get("ttft_s") or twin is None or twin["prompt_tokens"] != t["prompt_tokens"]:
            continue
        key = (_bucket(t["prompt_tokens"]), t.get("placement") or "-")
        groups.setdefault(key, []).append((t, twin))
    rows = []
    order = [bucket_name(low, high) for low, high in BUCKETS]
    for (bucket, reason), pairs in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        rows.append(
            {
                "bucket": bucket,
                "reason": reason,
                "turns": len(pairs),
                "ratio_p50": statistics.median(t["ttft_s"] / b["ttft_s"] for t, b in pairs),
                "ttft_p50_s": statistics.median(t["ttft_s"] for t, _ in pairs),
                "base_p50_s": statistics.median(b["ttft_s"] for _, b in pairs),
                "computed_p50": statistics.median(t["prompt_tokens"] - t["cached_tokens"] for t, _ in pairs),
            }
        )
    return rows


def compare(
    results: dict[str, Any], mode: str = "bidir", base: str = "dp", agents: int | None = None
) -> tuple[int | None, list[dict[str, Any]]]:
    """`by_reason` at `agents` (default: `highest_met`) from a results file's records."""
    if mode not in results["modes"] or base not in results["modes"]:
        return None, []
    agents = agents if agents is not None else highest_met(results, mode, base)
    # Keyed by the level's agents: an int in a run's own results, a string once read from JSON.
    by_level = {m: results["modes"][m].get("records") or {} for m in (mode, base)}
    mine, theirs = (by_level[m].get(agents, by_level[m].get(str(agents))) for m in (mode, base))
    if agents is None or not mine or not theirs:
        return agents, []
    return agents, by_reason(mine, theirs)


def format_rows(rows: list[dict[str, Any]], mode: str, base: str, agents: int | None) -> str:
    lines = [
        f"{mode} against {base}, turn by turn at {agents} agents, by placement (medians; "
        "`python -m bench.paired`):",
        "",
        f"| history | placed | turns | TTFT over {base}'s | TTFT (s) | {base}'s (s) | tokens computed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['bucket']} | {r['reason']} | {r['turns']} | {r['ratio_p50']:.2f} | {r['ttft_p50_s']:.3f} | "
        f"{r['base_p50_s']:.3f} | {r['computed_p50']:.0f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a fleet study's results (`python -m bench --profile fleet --out FILE`)")
    p.add_argument("--mode", default="bidir")
    p.add_argument("--base", default="dp")
    p.add_argument("--agents", type=int, help="the level (default: the highest both met)")
    args = p.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    agents, rows = compare(results, args.mode, args.base, args.agents)
    if not rows:
        print(f"no level of {args.mode} and {args.base} to pair (agents: {agents})")
        return 1
    print(format_rows(rows, args.mode, args.base, agents))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
