"""Aggregates measured turns into per-mode, per-turn statistics; writes the JSON results,
the TTFT plot and the markdown tables."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.apis import Api
from bench.runner import ModeRun
from bench.stats import mean

RATIOS = (("oneway", "bidir"), ("bidir", "single"))
API_NOTES = {
    Api.CHAT: "",
    Api.RESPONSES: (
        " Sessions spoke the Responses API (`/v1/responses`, chained by previous_response_id, only the "
        "new input each turn): TTFT to the first response.output_text.delta, cached from "
        "usage.input_tokens_details.cached_tokens, from decode and the app's timings from the response's "
        "kvturn extension."
    ),
    Api.MESSAGES: (
        " Sessions spoke Anthropic's Messages API (`/v1/messages`, whole history, no session header): TTFT "
        "to the first text_delta, prompt tokens input_tokens + cache_read_input_tokens, cached "
        "cache_read_input_tokens; the API has no kvturn extension, so from decode and the app's timings "
        "show -."
    ),
}


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _sum(values: Iterable[int | None]) -> int:
    return sum(v for v in values if v is not None)


def _sum_reported(values: Iterable[int | None]) -> int | None:
    """Like `_sum`, but None when every value is missing (an API without the `kvturn`
    extension reports none)."""
    xs = list(values)
    return None if xs and all(v is None for v in xs) else _sum(xs)


def _timings(records: list, key: str) -> list[float]:
    return [r.timings[key] for r in records if r.timings and r.timings.get(key) is not None]


def turn_stats(records: list) -> dict[str, Any]:
    """Statistics of a group of requests (one turn index of one mode, or all of a mode)."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok if (r.completion_tokens or 0) > 1]
    rates = [r.completion_tokens / r.e2e_s for r in ok if r.completion_tokens and r.e2e_s]
    prompt = _sum(r.prompt_tokens for r in ok)
    cached = _sum(r.cached_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": mean(ttft),
        "ttft_text_p50_s": percentile([r.ttft_text_s for r in ok if r.ttft_text_s is not None], 50),
        "ttft_text_mean_s": mean(r.ttft_text_s for r in ok if r.ttft_text_s is not None),
        "itl_mean_s": mean(itl),
        "tpot_mean_s": mean(tpot),
        "e2e_mean_s": mean(r.e2e_s for r in ok),
        "output_tok_s": mean(rates),
        "prompt_tokens_mean": mean(r.prompt_tokens for r in ok if r.prompt_tokens is not None),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "reused_from_decode": _sum_reported(r.reused_from_decode for r in ok),
        "completion_tokens": _sum(r.completion_tokens for r in ok),
        "miss_reasons": sorted({r.miss_reason for r in ok if r.miss_reason}),
        # The app's own breakdown (mean seconds from the turn's start at the ingress).
        "app_prefill_done_mean_s": mean(_timings(ok, "prefill_s")),
        "app_first_token_mean_s": mean(_timings(ok, "first_token_s")),
        "hops_mean_s": _hops(ok),
    }


def _hops(records: list) -> dict[str, float | None]:
    """Mean seconds of each hop of the time to first token (`app.api.metrics.turn_hops`)."""
    from app.api.metrics import turn_hops

    per_hop: dict[str, list[float]] = {}
    for r in records:
        for hop, seconds in turn_hops(r.timings or {}).items():
            per_hop.setdefault(hop, []).append(seconds)
    return {hop: mean(values) for hop, values in per_hop.items()}


def summarize(run: ModeRun, turns: int) -> dict[str, Any]:
    per_turn = []
    for t in range(1, turns + 1):
        group = [r for r in run.records if r.turn == t]
        per_turn.append({"turn": t, **turn_stats(group)})
    overall = turn_stats(run.records)
    overall["wall_s"] = run.wall_s
    overall["output_tok_s_aggregate"] = overall["completion_tokens"] / run.wall_s if run.wall_s else None
    later = [r for r in run.records if r.turn > 1]
    overall["later_turns"] = {
        k: v
        for k, v in turn_stats(later).items()
        if k.startswith(("ttft", "hops", "itl")) or k.endswith("tokens")
    }
    prefill = run.engines.get("prefill")
    return {
        "label": run.label,
        "api": Api(run.api).value,
        "deploy_s": run.deploy_s,
        "warmup_s": run.warmup_s,
        "turns": per_turn,
        "overall": overall,
        "engines": run.engines,
        # Prompt tokens of the prefill engine: pulled over NIXL vs computed (P/D modes);
        # the single engine's for `single`.
        "prefill_tokens": _prefill_tokens(prefill or run.engines.get("decode")),
        "kv_stats": run.kv_stats,
        "requests": [r.as_dict() for r in run.records],
    }


def _prefill_tokens(counts: dict | None) -> dict | None:
    if counts is None:
        return None
    return {
        "pulled": counts["prompt_tokens_external"],
        "local_hit": counts["prompt_tokens_local_hit"],
        "computed": counts["prompt_tokens_computed"],
        "total": counts["prompt_tokens_total"],
    }


def ratios(modes: dict[str, dict], turns: int) -> dict[str, Any]:
    """p50 TTFT ratios per turn (e.g. oneway/bidir: how many times faster bidir's first
    token is), and over turns 2.. (the turns that have a history)."""
    out: dict[str, Any] = {}
    for num, den in RATIOS:
        if num not in modes or den not in modes:
            continue
        rows = []
        for t in range(turns):
            a = modes[num]["turns"][t]["ttft_p50_s"]
            b = modes[den]["turns"][t]["ttft_p50_s"]
            rows.append({"turn": t + 1, "ttft_p50": (a / b) if a and b else None})
        a = modes[num]["overall"]["later_turns"].get("ttft_p50_s")
        b = modes[den]["overall"]["later_turns"].get("ttft_p50_s")
        out[f"{num}/{den}"] = {"per_turn": rows, "later_turns_ttft_p50": (a / b) if a and b else None}
    return out


def build_results(meta: dict, runs: list[ModeRun], turns: int) -> dict[str, Any]:
    modes = {run.label: summarize(run, turns) for run in runs}
    return {**meta, "modes": modes, "ratios": ratios(modes, turns)}


# -- output ------------------------------------------------------------------------------


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def plot(results: dict, path: Path) -> Path | None:
    """TTFT p50 vs turn, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for label, mode in results["modes"].items():
        xs = [row["turn"] for row in mode["turns"] if row["ttft_p50_s"] is not None]
        ys = [row["ttft_p50_s"] for row in mode["turns"] if row["ttft_p50_s"] is not None]
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    w = results.get("workload", {})
    ax.set_title(
        f"kvturn: time to first token per turn ({results.get('profile', '')}, {w.get('sessions')} sessions, "
        f"{results.get('api', Api.CHAT.value)} API)"
    )
    ax.set_xticks(range(1, (w.get("turns") or 1) + 1))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _f(x: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _i(x: int | float | None) -> str:
    return "-" if x is None else f"{round(x):,}"


def _pair(pre: dict | None, dec: dict | None, key: str, fmt) -> str:
    """A transfer counter of prefill and decode engines ("-" without transfers)."""
    if pre is None or dec is None or key not in pre:
        return "-"
    return f"{fmt(pre[key])} / {fmt(dec[key])}"


def _pulls(counts: dict | None) -> str:
    """Ingress turn counters: handles offered to prefill, and prefill legs that timed out."""
    if not counts or not counts.get("handle_used"):
        return "-"
    return f"{counts.get('handle_used', 0)} / {counts.get('pull_timeout', 0)}"


def markdown(results: dict) -> str:
    """Two tables: TTFT per turn across modes (with ratios), then per mode and turn."""
    modes = results["modes"]
    labels = list(modes)
    turns = len(next(iter(modes.values()))["turns"]) if modes else 0
    lines = []
    w = results.get("workload", {})
    api = Api(results.get("api", Api.CHAT.value))
    lines.append(
        f"Profile `{results.get('profile')}`: model `{results.get('model_name')}`, API `{api.value}`, "
        f"{w.get('sessions')} sessions x {w.get('turns')} turns (concurrency {w.get('concurrency')}), "
        f"answers {w.get('answer_tokens')} tokens, tool results ~{w.get('tool_tokens')} tokens."
    )
    e = results.get("engine") or {}
    if e:
        threads = e.get("cpu_threads") or (e.get("env") or {}).get("OMP_NUM_THREADS")
        lines.append(
            f"Engines: {e.get('dtype')}, {'eager' if e.get('enforce_eager') else 'compiled'}, "
            f"prefill prefix caching {'on' if e.get('prefill_prefix_caching') else 'off'}"
            + (f", {threads} CPU thread(s) each" if threads else "")
            + f"; host: {results.get('host', {}).get('cpus')} CPUs."
        )
    lines.append("")
    head = ["turn", "prompt tokens"] + [f"TTFT p50 {m} (s)" for m in labels]
    ratio_keys = [k for k in results.get("ratios", {})]
    head += [k for k in ratio_keys]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---:" for _ in head) + "|")
    for t in range(turns):
        prompt = next(
            (
                modes[m]["turns"][t]["prompt_tokens_mean"]
                for m in labels
                if modes[m]["turns"][t]["prompt_tokens_mean"]
            ),
            None,
        )
        row = [str(t + 1), _i(prompt)]
        row += [_f(modes[m]["turns"][t]["ttft_p50_s"]) for m in labels]
        row += [_f(results["ratios"][k]["per_turn"][t]["ttft_p50"]) + "x" for k in ratio_keys]
        lines.append("| " + " | ".join(row) + " |")
    if ratio_keys:
        row = ["2..", ""] + [_f(modes[m]["overall"]["later_turns"].get("ttft_p50_s")) for m in labels]
        row += [_f(results["ratios"][k]["later_turns_ttft_p50"]) + "x" for k in ratio_keys]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    hop_names = [
        "store",
        "verify",
        "prefill_engine",
        "prefill_transport",
        "decode_engine",
        "decode_transport",
    ]
    if any(modes[m]["overall"]["later_turns"].get("hops_mean_s") for m in labels):
        lines.append(
            "Where the time to first token went, turns 2 and later (mean ms, from `kvturn.timings`):"
        )
        lines.append("")
        head = ["mode"] + hop_names + ["client TTFT"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
        for m in labels:
            later = modes[m]["overall"]["later_turns"]
            hops = later.get("hops_mean_s") or {}
            row = [m] + [_f(hops.get(h), 1, 1000.0) if h in hops else "-" for h in hop_names]
            row.append(_f(later.get("ttft_mean_s"), 1, 1000.0))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    head = [
        "mode",
        "turn",
        "TTFT p50 (s)",
        "TTFT p90 (s)",
        "TTFT mean (s)",
        "prefill leg done (s)",
        "first token at ingress (s)",
        "ITL mean (ms)",
        "out tok/s",
        "cached",
        "computed",
        "from decode",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for m in labels:
        for row in modes[m]["turns"]:
            lines.append(
                "| "
                + " | ".join(
                    [
                        m,
                        str(row["turn"]),
                        _f(row["ttft_p50_s"]),
                        _f(row["ttft_p90_s"]),
                        _f(row["ttft_mean_s"]),
                        _f(row.get("app_prefill_done_mean_s")),
                        _f(row.get("app_first_token_mean_s")),
                        _f(row["itl_mean_s"], 1, 1000),
                        _f(row["output_tok_s"], 1),
                        _i(row["cached_tokens"]),
                        _i(row["computed_tokens"]),
                        _i(row["reused_from_decode"]),
                    ]
                )
                + " |"
            )
    lines.append("")
    head = [
        "mode",
        "wall (s)",
        "deploy (s)",
        "out tok/s (all)",
        "prefill pulled",
        "prefill local hit",
        "prefill computed",
        "decode pulled",
        "pulls used / timed out",
        "NIXL reads P / D",
        "read time P / D (s)",
        "read MB P / D",
        "errors",
    ]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for m in labels:
        mode = modes[m]
        o = mode["overall"]
        pre = mode["engines"].get("prefill") if mode["engines"] else None
        dec = mode["engines"].get("decode") if mode["engines"] else None
        single = pre is None and dec is not None
        first = (dec if single else pre) if (pre or dec) else None  # the engine that gets the prompt
        lines.append(
            "| "
            + " | ".join(
                [
                    m,
                    _f(o["wall_s"], 1),
                    _f(mode["deploy_s"], 0),
                    _f(o["output_tok_s_aggregate"], 1),
                    _i(pre["prompt_tokens_external"]) if pre else "-",
                    _i(first["prompt_tokens_local_hit"]) if first is not None else "-",
                    _i(first["prompt_tokens_computed"]) if first is not None else "-",
                    _i(dec["prompt_tokens_external"]) if dec and not single else "-",
                    _pulls(mode.get("kv_stats")),
                    _pair(pre, dec, "kv_transfers", _i),
                    _pair(pre, dec, "kv_transfer_s", lambda x: _f(x, 2)),
                    _pair(pre, dec, "kv_transfer_bytes", lambda x: _f(x / 1e6, 0)),
                    str(o["errors"]),
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append(
        "TTFT: request sent to first content chunk. cached: prompt tokens the first engine did not compute "
        "(usage.prompt_tokens_details.cached_tokens); from decode: history offered to prefill from the "
        "decode engine (kvturn.reused_from_decode). Engine columns count prompt tokens over the measured "
        "phase; for single they are the one engine's. Token columns per turn are sums over the turn's "
        "requests. prefill leg done / first token at ingress: the app's own timings (kvturn.timings), mean "
        "seconds from the turn's arrival at the ingress. NIXL reads: transfers each engine made (prefill "
        "pulling history from decode, decode reading new blocks from prefill), their total time and size, "
        "from the NixlConnector's own stats." + API_NOTES[api]
    )
    return "\n".join(lines)
