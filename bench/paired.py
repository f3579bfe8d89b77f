"""Turn by turn: where one mode's time to first token goes against another's.

The fleet study runs the same trace in every mode (`bench.fleet`: each level's agents,
sessions and prompts are the same), so each turn of one mode has a twin in another, with
the same prompt. `by_reason` pairs the twins of one level and groups them by where the
app placed the turn (`kvturn.placement`: `short`, `sooner`, `itl`, ...), per history
bucket: how many, the median of their TTFT over their twins', both medians, and the
median of the tokens the engines computed for them. A bucket's TTFT p50 in
`bench.fleet.ratios` is taken over all of these groups' turns; this says which moves it.

`by_bucket` gives each history bucket's (and the long tool results') TTFT p50 and p90
over the twins', with a 95% interval from resampling the level's turns: how far such a
ratio of a few dozen turns moves on the same load. `--mode dp-again` (dp deployed twice in
one run) measures it: the same setup against itself.

    python -m bench.paired results/fleet.json [--mode bidir] [--base dp] [--agents 4]

Without `--agents`: the highest level both modes met the target at.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Collection, Sequence
from typing import Any

from bench.stats import BUCKETS, bucket_name, paired_quantile_ratio, share_over


def _bucket(prompt_tokens: int) -> str:
    return next(bucket_name(low, high) for low, high in BUCKETS if low <= prompt_tokens < high)


def highest_met(results: dict[str, Any], mode: str, base: str) -> int | None:
    """The most agents at which both modes met the target (None: no such level)."""
    met = [{lv["agents"] for lv in results["modes"][m]["levels"] if lv["meets_slo"]} for m in (mode, base)]
    both = met[0] & met[1]
    return max(both) if both else None


def _pairs(records: Sequence[dict[str, Any]], twins: Sequence[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """`records` (one mode's turns at a level) with their `twins` (another mode's, the same
    level), paired by session and turn. Turns that failed in either, or whose prompts
    differ, are left out."""
    other = {(t["session"], t["turn"]): t for t in twins if t["ok"] and t.get("ttft_s")}
    pairs = []
    for t in records:
        twin = other.get((t["session"], t["turn"]))
        if t["ok"] and t.get("ttft_s") and twin is not None and twin["prompt_tokens"] == t["prompt_tokens"]:
            pairs.append((t, twin))
    return pairs


def by_reason(records: Sequence[dict[str, Any]], twins: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of (bucket, reason): `records` against their `twins` (`_pairs`)."""
    groups: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for t, twin in _pairs(records, twins):
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


def by_bucket(
    records: Sequence[dict[str, Any]],
    twins: Sequence[dict[str, Any]],
    long_tools: Collection[tuple[int, int]] = (),
) -> list[dict[str, Any]]:
    """Per history bucket, and for the turns with long tool results (`long_tools`: their
    (session, turn)), TTFT p50 and p90 over the twins' (`_pairs`) as `bench.fleet.ratios`
    takes them, each with its 95% interval (`bench.stats.paired_quantile_ratio`)."""
    pairs = _pairs(records, twins)
    groups = {
        bucket_name(low, high): [p for p in pairs if low <= p[0]["prompt_tokens"] < high]
        for low, high in BUCKETS
    }
    long = {tuple(turn) for turn in long_tools}
    groups["long_tool"] = [p for p in pairs if (p[0]["session"], p[0]["turn"]) in long]
    rows = []
    for name, group in groups.items():
        if group:
            ttfts = [(t["ttft_s"], b["ttft_s"]) for t, b in group]
            rows.append({"bucket": name, "turns": len(group)})
            rows[-1].update({f"p{round(q * 100)}": paired_quantile_ratio(ttfts, q) for q in (0.5, 0.9)})
    return rows


def _level(results: dict[str, Any], mode: str, agents: int | None) -> tuple[list[dict], dict]:
    """A mode's records and figures at `agents` (keyed by an int in a run's own results, a
    string once read from JSON)."""
    records = results["modes"][mode].get("records") or {}
    level: dict[str, Any] = next(
        (lv for lv in results["modes"][mode]["levels"] if lv["agents"] == agents), {}
    )
    return records.get(agents, records.get(str(agents))) or [], level


def compare(
    results: dict[str, Any],
    mode: str = "bidir",
    base: str = "dp",
    agents: int | None = None,
    buckets: bool = False,
) -> tuple[int | None, list[dict[str, Any]]]:
    """`by_reason` (`buckets`: `by_bucket`) at `agents` (default: `highest_met`) from a
    results file's records."""
    if mode not in results["modes"] or base not in results["modes"]:
        return None, []
    agents = agents if agents is not None else highest_met(results, mode, base)
    (mine, level), (theirs, _) = _level(results, mode, agents), _level(results, base, agents)
    if agents is None or not mine or not theirs:
        return agents, []
    if buckets:
        return agents, by_bucket(mine, theirs, level.get("long_tools", ()))
    return agents, by_reason(mine, theirs)


def format_late(results: dict[str, Any], modes: Sequence[str], agents: int | None) -> str:
    """Each of `modes`' output gaps at `agents` past the run's ITL target (from its
    records): what each spent of the 1% its p99 allows. A mode that computes prompts where
    streams decode buys its time to first token with these."""
    target = results["slo"]["itl_p99_s"]
    shares = []
    for mode in modes:
        records, _ = _level(results, mode, agents)
        share = share_over((g for r in records if r["ok"] for g in r["itl_s"]), target)
        shares.append(f"{mode} " + ("-" if share is None else f"{100 * share:.2f}%"))
    return (
        f"Outputs past the ITL target ({1000 * target:.0f} ms) at {agents} agents, of the 1% "
        f"its p99 allows: {', '.join(shares)}."
    )


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


def format_buckets(rows: list[dict[str, Any]], mode: str, base: str, agents: int | None) -> str:
    def cell(r: tuple[float | None, float | None, float | None]) -> str:
        return "-" if r[0] is None else f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"

    lines = [
        f"{mode} against {base} at {agents} agents, the same turns (95% intervals from resampling them):",
        "",
        f"| history | turns | TTFT p50 over {base}'s | TTFT p90 over {base}'s |",
        "| --- | ---: | --- | --- |",
    ]
    lines += [f"| {r['bucket']} | {r['turns']} | {cell(r['p50'])} | {cell(r['p90'])} |" for r in rows]
    return "\n".join(lines)


def tables(results: dict[str, Any], modes: Sequence[str] = ("bidir", "bidir-host", "dp-again")) -> list[str]:
    """The paired tables of a run's report (`bench.fleet.markdown`): each of `modes` it ran
    against dp, by bucket, and against dp deployed again after it (`dp-again`: a run
    `dp,MODE,dp-again` brackets MODE, so the machine's drift over the run shows); the
    default's also by placement."""
    lines: list[str] = []
    for mode in modes:
        for base in ("dp", "dp-again"):
            if base != mode and (paired := compare(results, mode, base, buckets=True))[1]:
                lines += ["", format_buckets(paired[1], mode, base, paired[0])]
                lines += ["", format_late(results, (mode, base), paired[0])]
        if mode == "bidir" and (paired := compare(results, mode))[1]:
            lines += ["", format_rows(paired[1], mode, "dp", paired[0])]
    return lines


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
    _, buckets = compare(results, args.mode, args.base, agents, buckets=True)
    print("\n" + format_buckets(buckets, args.mode, args.base, agents))
    print("\n" + format_late(results, (args.mode, args.base), agents))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
