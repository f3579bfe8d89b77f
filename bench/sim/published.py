"""The published Qwen3-32B case (`python -m bench.sim --validate`, its second part).

An AWS-authored write-up (1P1D on two p5en.48xlarge, TP8, vLLM's multi-turn benchmark)
reports TTFT 778 ms one-way against 460 ms with the decode->prefill pull at 24k tokens,
1.6x. Both are means over every request of vLLM's multi-turn benchmark
(benchmarks/multi_turn), so the case is that benchmark as its README runs it
(`--num-clients 2 --max-active-conversations 6`) on its generator's defaults
(`generate_multi_turn.json`: 24 conversations of 12-18 messages, user turns of 120-160
tokens, answers of 80-120), with each conversation's first prompt at 24k tokens (the
write-up gives no more than "24k": an assumption). The first turn of every conversation
computes its whole prompt in both modes. The engines' MFU is fitted to the one-way mean;
the pull's mean (and so the ratio) is then predicted. Band: ratio within +-25%.

Each NIXL read costs its transfer (a fixed cost fitted to the write-up's 30-130 ms, then
EFA's line rate) and a hand-off beyond it, as vLLM RFC #50913 traced vLLM's NixlConnector
on 8 L20 GPUs (Qwen3-32B-FP8, TP2, 3P1D, block size 64): 197 ms p50 from the prefill's
first token to the client's, of which the KV transfer is 29 ms and the first token's
recompute, step alignment included, 58 ms (the simulated engines step for that); the
other 110 ms are dispatch to the workers, completion notices and that router's serial
dispatch. Another GPU and router, and this app has no serial dispatch: an upper reading
of the hand-off. `READS` prices each read the other ways: the transfer alone, and at the
rate the RFC measured (167 MB in 38.7 ms on average, 4.3 GB/s).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bench.sim.fleet import FleetSpec
from bench.sim.params import (
    EFA_BYTES_PER_S_PER_GPU,
    GPU_NIXL_HANDOFF_S,
    GPU_NIXL_LATENCY_S,
    GPU_NIXL_READ_S,
    Hardware,
    gpu_qwen3_32b,
)
from bench.traces import Trace, TraceSession, TraceTurn

GPU_BAND = 0.25

GPU_HISTORY_TOKENS = 24_000
GPU_NEW_TOKENS = 140
GPU_ANSWER_TOKENS = 100
PUBLISHED_ONEWAY_S = 0.778
PUBLISHED_PULL_S = 0.460
PUBLISHED_RATIO = PUBLISHED_ONEWAY_S / PUBLISHED_PULL_S
BENCH_CONVERSATIONS = 24
BENCH_CLIENTS, BENCH_ACTIVE = 2, 6
"""vLLM benchmarks/multi_turn: the generator's 24 conversations; the README's invocation."""


READ_MEASURED_BYTES_PER_S = 167e6 / 0.0387
"""vLLM RFC #50913: decode-side transfers of 167 MB in 38.7 ms on average (4.3 GB/s)."""
READS = {
    "line-rate": ("the transfer alone, no hand-off", GPU_NIXL_LATENCY_S, EFA_BYTES_PER_S_PER_GPU),
    "measured-rate": ("the RFC's 4.3 GB/s, no hand-off", 0.0, READ_MEASURED_BYTES_PER_S),
    "measured-handoff": (
        "transfers at the RFC's 4.3 GB/s and its 110 ms of hand-off",
        GPU_NIXL_HANDOFF_S,
        READ_MEASURED_BYTES_PER_S,
    ),
}
"""The other readings of a NIXL read (what, fixed seconds, bytes/s per GPU); the model's
own is the transfer at EFA's line rate and the RFC's hand-off (`GPU_NIXL_READ_S`).
`python -m bench.sim --project --reads KEY` projects with one."""
DEFAULT_READS = "line-rate-handoff"


def benchmark_trace(first_prompt: int = GPU_HISTORY_TOKENS, seed: int = 0) -> Trace:
    """vLLM's multi-turn benchmark's conversations (`generate_multi_turn.json`'s defaults)
    with a first prompt of `first_prompt` tokens: 12-18 messages (rounded up to even, so
    6-9 user turns), user turns of 120-160 tokens, answers of 80-120, 500 tokens of
    common prefix."""
    rng = random.Random(seed)
    sessions = []
    for c in range(BENCH_CONVERSATIONS):
        messages = rng.randint(12, 18)
        user_turns = (messages + 1) // 2
        turns = [TraceTurn("user", first_prompt - 500, rng.randint(80, 120))]
        turns += [
            TraceTurn("user", rng.randint(120, 160), rng.randint(80, 120)) for _ in range(user_turns - 1)
        ]
        sessions.append(TraceSession(f"c{c}", 0.0, 500, tuple(turns)))
    return Trace(tuple(sessions), source="vllm-multi-turn-benchmark")


def gpu_mean_ttft(
    mode: str,
    mfu: float,
    placement: str = "priced",
    nixl_latency_s: float = GPU_NIXL_READ_S,
    efa_bytes_per_s_per_gpu: float = EFA_BYTES_PER_S_PER_GPU,
) -> tuple[float, float]:
    """(mean TTFT of every request, mean TTFT of the turns after each conversation's
    first) of the multi-turn benchmark on 1P1D TP8 H200."""
    from bench.sim.fleet import Fleet

    hw = gpu_qwen3_32b(
        tp=8, mfu=mfu, nixl_latency_s=nixl_latency_s, efa_bytes_per_s_per_gpu=efa_bytes_per_s_per_gpu
    )
    fleet = Fleet(FleetSpec(mode, hw, placement=placement))
    run = fleet.run_clients(benchmark_trace(), BENCH_CLIENTS, BENCH_ACTIVE)
    every = [t.ttft_s for t in run.turns]
    later = [t.ttft_s for t in run.turns if t.turn > 1]
    return sum(every) / len(every), sum(later) / len(later)


def _two_turns() -> Trace:
    first = TraceTurn("user", GPU_HISTORY_TOKENS - 500, GPU_ANSWER_TOKENS)
    second = TraceTurn("user", GPU_NEW_TOKENS, GPU_ANSWER_TOKENS, pause_s=1.0)
    return Trace((TraceSession("s0", 0.0, 500, (first, second)),), source="published-case")


def gpu_turn2_ttft(mode: str, mfu: float, placement: str = "priced") -> float:
    """TTFT of the second turn (24k history) of one conversation alone on 1P1D TP8 H200."""
    from bench.sim.fleet import Fleet

    fleet = Fleet(FleetSpec(mode, gpu_qwen3_32b(tp=8, mfu=mfu), placement=placement))
    run = fleet.run(_two_turns())
    return next(t.ttft_s for t in run.turns if t.turn == 2)


def _crossing(
    too_low: Callable[[float], bool], low: float, high: float, steps: int, log: bool = False
) -> float:
    """The value in [`low`, `high`] where `too_low` turns false (bisection, `steps` halvings;
    `log`: on a log scale)."""

    def middle(a: float, b: float) -> float:
        return (a * b) ** 0.5 if log else (a + b) / 2

    for _ in range(steps):
        mid = middle(low, high)
        if too_low(mid):
            low = mid
        else:
            high = mid
    return middle(low, high)


def fit_mfu(
    target_s: float = PUBLISHED_ONEWAY_S,
    nixl_latency_s: float = GPU_NIXL_READ_S,
    efa_bytes_per_s_per_gpu: float = EFA_BYTES_PER_S_PER_GPU,
) -> float:
    """The MFU at which the simulated benchmark's one-way mean TTFT is `target_s` over
    this link (bisection)."""

    def too_low(mfu: float) -> bool:
        oneway, _ = gpu_mean_ttft(
            "oneway", mfu, nixl_latency_s=nixl_latency_s, efa_bytes_per_s_per_gpu=efa_bytes_per_s_per_gpu
        )
        return oneway > target_s

    return _crossing(too_low, 0.05, 1.0, 20)


def _means(
    mfu: float,
    nixl_latency_s: float = GPU_NIXL_READ_S,
    efa_bytes_per_s_per_gpu: float = EFA_BYTES_PER_S_PER_GPU,
) -> tuple[float, float]:
    """The simulated benchmark's mean TTFT of every request, one-way and with the pull,
    over this link."""
    oneway, pulled = (
        gpu_mean_ttft(
            mode, mfu, nixl_latency_s=nixl_latency_s, efa_bytes_per_s_per_gpu=efa_bytes_per_s_per_gpu
        )[0]
        for mode in ("oneway", "bidir-pd")
    )
    return oneway, pulled


def _pull_ratio(
    mfu: float,
    nixl_latency_s: float = GPU_NIXL_READ_S,
    efa_bytes_per_s_per_gpu: float = EFA_BYTES_PER_S_PER_GPU,
) -> float:
    """The simulated benchmark's one-way / pull ratio of mean TTFTs over this link."""
    oneway, pulled = _means(mfu, nixl_latency_s, efa_bytes_per_s_per_gpu)
    return oneway / pulled


def _within_band(ratio: float) -> bool:
    return abs(ratio / PUBLISHED_RATIO - 1.0) <= GPU_BAND


def read_latency_to_match(mfu: float, ratio: float) -> float:
    """The fixed cost of one NIXL read at which the simulated one-way / pull ratio of the
    benchmark's means is `ratio` (MFU held; bisection)."""
    return _crossing(lambda latency: _pull_ratio(mfu, nixl_latency_s=latency) > ratio, 0.0, 2.0, 16)


def read_bandwidth_to_match(mfu: float, ratio: float) -> float | None:
    """The NIXL read bandwidth per GPU (bytes/s) at which the simulated one-way / pull ratio
    of the benchmark's means is `ratio` (MFU and read latency held; bisection on a log
    scale). At TP8 each GPU holds one of Qwen3-32B's 8 KV heads, so a read moves one
    block of one head per layer per descriptor (a few KiB): a link's rate of messages, not
    its line rate, may bound it. None: the ratio is `ratio` or less at the line rate."""
    if _pull_ratio(mfu) <= ratio:
        return None
    return _crossing(
        lambda bandwidth: _pull_ratio(mfu, efa_bytes_per_s_per_gpu=bandwidth) <= ratio,
        1e8,
        EFA_BYTES_PER_S_PER_GPU,
        16,
        log=True,
    )


def gpu_case() -> dict[str, Any]:
    mfu = fit_mfu()
    oneway, oneway_later = gpu_mean_ttft("oneway", mfu)
    pulled, pulled_later = gpu_mean_ttft("bidir-pd", mfu)
    default, default_later = gpu_mean_ttft("bidir", mfu)
    ratio = oneway / pulled
    return {
        "mfu": mfu,
        "oneway_s": oneway,
        "pull_s": pulled,
        "default_s": default,
        "oneway_later_s": oneway_later,
        "pull_later_s": pulled_later,
        "default_later_s": default_later,
        "alone_oneway_s": gpu_turn2_ttft("oneway", mfu),
        "alone_pull_s": gpu_turn2_ttft("bidir-pd", mfu),
        "ratio": ratio,
        "published_ratio": PUBLISHED_RATIO,
        "within": _within_band(ratio),
        "read_latency_to_match_s": read_latency_to_match(mfu, PUBLISHED_RATIO),
        "read_bandwidth_to_match": read_bandwidth_to_match(mfu, PUBLISHED_RATIO),
        "read_measured": [measured_read(*read) for read in READS.values()],
    }


def measured_read(name: str, fixed_s: float, bytes_per_s: float) -> dict[str, Any]:
    """The ratio with each read priced at `fixed_s` plus its bytes at `bytes_per_s` per
    GPU, the MFU refitted so that one-way's mean stays the published one."""
    mfu = fit_mfu(nixl_latency_s=fixed_s, efa_bytes_per_s_per_gpu=bytes_per_s)
    oneway, pulled = _means(mfu, fixed_s, bytes_per_s)
    ratio = oneway / pulled
    return {
        "name": name,
        "mfu": mfu,
        "oneway_s": oneway,
        "pull_s": pulled,
        "ratio": ratio,
        "within": _within_band(ratio),
    }


def read_cost(reads: str) -> tuple[str, float, float]:
    """(what, fixed seconds, bytes/s per GPU) of a NIXL read: the model's own, a `READS` key, or
    "MS:GBPS" for reads measured elsewhere (a fixed cost in milliseconds, and the rate one
    GPU's reads reach in GB/s: from the app's `ray_kvturn_nixl_transfer_*` counters)."""
    if reads == DEFAULT_READS:
        return reads, GPU_NIXL_READ_S, EFA_BYTES_PER_S_PER_GPU
    if reads in READS:
        what, fixed_s, bytes_per_s = READS[reads]
        return f"{reads} ({what})", fixed_s, bytes_per_s
    try:
        ms, gbps = (float(x) for x in reads.split(":"))
    except ValueError:
        raise ValueError(
            f"reads {reads!r}: one of {', '.join([DEFAULT_READS, *READS])}, or MS:GBPS (e.g. 20:12)"
        ) from None
    if ms < 0 or gbps <= 0:
        raise ValueError(f"reads {reads!r}: a fixed cost >= 0 ms and a rate > 0 GB/s")
    return f"{ms:g} ms + {gbps:g} GB/s a GPU", ms / 1e3, gbps * 1e9


def with_reads(reads: str, tp: int) -> Hardware:
    """Qwen3-32B engines of `tp` GPUs whose NIXL reads cost as `read_cost(reads)` says, the
    MFU refitted so that the published case's one-way mean stays 778 ms."""
    what, fixed_s, bytes_per_s = read_cost(reads)
    mfu = fit_mfu(nixl_latency_s=fixed_s, efa_bytes_per_s_per_gpu=bytes_per_s)
    hw = gpu_qwen3_32b(tp=tp, mfu=mfu, nixl_latency_s=fixed_s, efa_bytes_per_s_per_gpu=bytes_per_s)
    return replace(hw, name=f"{hw.name}, reads {what}")


def format_case(gpu: dict[str, Any]) -> str:
    """The case as `--validate` prints it."""
    lines = [
        "Qwen3-32B, 1P1D TP8 on H200, vLLM's multi-turn benchmark (2 clients, 6 active "
        "conversations, first prompts of 24k tokens; published means: 778 ms one-way, 460 ms "
        "with the pull, 1.69x), band +-25%:",
        f"  MFU fitted to the one-way mean: {gpu['mfu']:.3f}",
        f"  mean TTFT one-way {gpu['oneway_s'] * 1e3:.0f} ms, pull {gpu['pull_s'] * 1e3:.0f} ms: "
        f"{gpu['ratio']:.2f}x against {gpu['published_ratio']:.2f}x published "
        f"({'within' if gpu['within'] else 'OUTSIDE'} the band)",
        f"  turns after the first: one-way {gpu['oneway_later_s'] * 1e3:.0f} ms, pull "
        f"{gpu['pull_later_s'] * 1e3:.0f} ms, the app's default placement "
        f"{gpu['default_later_s'] * 1e3:.0f} ms (mean of every request {gpu['default_s'] * 1e3:.0f} ms)",
        f"  one conversation alone, its second turn: one-way {gpu['alone_oneway_s'] * 1e3:.0f} ms, "
        f"pull {gpu['alone_pull_s'] * 1e3:.0f} ms",
        f"  to match 1.69x, each NIXL read would cost {gpu['read_latency_to_match_s'] * 1e3:.0f} ms "
        f"of fixed time (modelled: {GPU_NIXL_LATENCY_S * 1e3:.0f} ms of transfer, the write-up's "
        f"30-130 ms, and {GPU_NIXL_HANDOFF_S * 1e3:.0f} ms of hand-off, vLLM RFC #50913's)",
        (
            f"  or, its latency held, each GPU would read at {bandwidth / 1e9:.1f} GB/s "
            f"(modelled: {EFA_BYTES_PER_S_PER_GPU / 1e9:.0f} GB/s, EFA's line rate)"
            if (bandwidth := gpu["read_bandwidth_to_match"])
            else "  (no read rate would: at EFA's line rate the modelled pull is slower than published)"
        ),
        "  each read priced another way (the MFU refitted each time):",
    ]
    for m in gpu.get("read_measured", ()):
        lines.append(
            f"    {m['name']}: MFU {m['mfu']:.3f}, one-way {m['oneway_s'] * 1e3:.0f} ms, pull "
            f"{m['pull_s'] * 1e3:.0f} ms: {m['ratio']:.2f}x "
            f"({'within' if m['within'] else 'outside'} the band)"
        )
    return "\n".join(lines)
