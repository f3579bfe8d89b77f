"""Cost models of the simulated fleet: what one engine step, one KV transfer and one
Serve hop cost.

An engine (one vLLM engine, one tensor-parallel group) runs steps. A step carries the
sequences that are decoding (one token each) and up to `chunk_tokens` prompt tokens of
the requests waiting for prefill (chunked prefill, as vLLM's scheduler fills a step's
token budget: decodes first, then prefill chunks in arrival order). Its time is

    step_s + decode_seq_s * batch + decode_ctx_s * (context tokens the batch reads)
           + sum over prefill chunks of  chunk_s + chunk_ctx_s * cached
                                          + new * (token_s + attn_s * (cached + new / 2))

`token_s` is the per-token cost of the dense layers, `attn_s` what a new token pays per
token of context it attends to (the context grows through a chunk, hence `new / 2`).
The same form serves the CPU engines (fitted from measured step and leg times) and the
GPU engines (derived from published FLOP and memory-bandwidth figures,
`bench.sim.params`). Pure functions; no simulation state.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCost:
    step_s: float
    """Fixed time of one step (scheduling, kernel launches; on GPU, reading the weights)."""
    token_s: float
    """Per prompt token computed, dense layers."""
    attn_s: float
    """Per prompt token computed, per context token it attends to."""
    decode_seq_s: float
    """Per sequence decoding in the step."""
    decode_ctx_s: float
    """Per context token the decoding sequences read."""
    chunk_tokens: int
    """Prompt tokens one step computes at most (vLLM's `max_num_batched_tokens`)."""
    chunk_s: float = 0.0
    """Per prefill chunk in a step, beyond `step_s`: what a lone prefill leg's fixed time
    exceeds a decode step's (measured on CPU; 0 on GPU, where no figure gives it)."""
    chunk_ctx_s: float = 0.0
    """Per prefill chunk, per cached token of its context: the chunk reads the cached KV
    once, as a decode step does (measured on CPU; 0 on GPU, folded into `attn_s`)."""

    def prefill_s(self, new: int, cached: int = 0) -> float:
        """Compute time of `new` prompt tokens over `cached` tokens already in the cache."""
        if new <= 0:
            return 0.0
        return new * (self.token_s + self.attn_s * (cached + new / 2.0)) + self.chunk_ctx_s * cached

    def step(self, batch: int, context: int, chunks: Sequence[tuple[int, int]] = ()) -> float:
        """One step: `batch` sequences decoding over `context` tokens in all, and prefill
        `chunks` of (new, cached) tokens."""
        return (
            self.step_s
            + self.decode_seq_s * batch
            + self.decode_ctx_s * context
            + sum(self.chunk_s + self.prefill_s(n, c) for n, c in chunks)
        )

    def cold_prefill_s(self, tokens: int) -> float:
        """A whole prompt computed alone, chunk after chunk (each chunk a step)."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(self.chunk_tokens, tokens - done)
            total += self.step_s + self.chunk_s + self.prefill_s(n, done)
            done += n
        return total


@dataclass(frozen=True)
class Link:
    """A KV transfer path (NIXL): a fixed cost per read plus bytes over bandwidth."""

    latency_s: float
    bytes_per_s: float

    def transfer_s(self, tokens: int, kv_bytes_per_token: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * kv_bytes_per_token / self.bytes_per_s


Jitter = tuple[tuple[float, float], ...]
"""(ratio, share) pairs: the share of outputs whose gap, as the client sees it, is that
many times its engine's step (the serving path's own variation); the shares sum to 1."""

JITTER_EDGES = (0.0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.998, 1.0)
"""Quantile bins a `Jitter` is summarised over: finer in the tail, where a p99 lives."""


def jitter_of(streams: Sequence[Sequence[float]], min_gaps: int = 5) -> Jitter:
    """A `Jitter` from measured streams (each its client-side gaps between outputs): every
    gap over its stream's median gap, summarised as the mean ratio of each `JITTER_EDGES`
    bin. Streams of fewer than `min_gaps` gaps are left out."""
    ratios = sorted(
        gap / med
        for gaps in streams
        if len(gaps) >= min_gaps and (med := statistics.median(gaps)) > 0
        for gap in gaps
    )
    if not ratios:
        return ()
    n = len(ratios)
    out = []
    for low, high in zip(JITTER_EDGES, JITTER_EDGES[1:], strict=False):
        part = ratios[int(low * n) : max(int(low * n) + 1, int(high * n))]
        out.append((round(sum(part) / len(part), 2), round(high - low, 4)))
    return tuple(out)


def jittered(samples: Sequence[tuple[float, float]], jitter: Jitter) -> list[tuple[float, float]]:
    """Weighted gap samples (seconds, outputs) as the client sees them: each spread over
    `jitter`'s ratios by their shares (the weights are kept in total)."""
    if not jitter:
        return list(samples)
    return [(gap * ratio, count * share) for gap, count in samples for ratio, share in jitter]


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks holding `tokens` positions."""
    return math.ceil(max(0, tokens) / block_size)


def fit_prefill(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """(fixed seconds, `token_s`, `attn_s`, `chunk_ctx_s`) that best fit measured prefill legs.

    `points`: (new tokens computed, cached tokens, seconds to the first output) of
    single requests measured alone (`python -m bench.prefill_cost --grid`); each is
    modelled as one step of `EngineCost.prefill_s` plus a fixed time:
    `fixed + new * (token_s + attn_s * (cached + new / 2)) + chunk_ctx_s * cached`.
    Least squares of the relative error (a 10 ms leg counts as much as a 2 s one), no
    coefficient below 0."""
    rows = [(1.0, float(n), n * (c + n / 2.0), float(c)) for n, c, _ in points]
    fixed, token_s, attn_s, ctx_s = least_squares(rows, [s for *_, s in points])
    return fixed, token_s, attn_s, ctx_s


def fit_decode(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(`step_s`, `decode_seq_s`, `decode_ctx_s`) that best fit measured decode steps.

    `points`: (sequences decoding, context tokens of each, seconds a step) of batches
    measured alone; each step is modelled as `EngineCost.step` with no prefill:
    `step_s + decode_seq_s * batch + decode_ctx_s * batch * context`. Least squares of the
    relative error, no coefficient below 0."""
    rows = [(1.0, float(b), float(b * c)) for b, c, _ in points]
    step_s, seq_s, ctx_s = least_squares(rows, [s for *_, s in points])
    return step_s, seq_s, ctx_s


def least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[float, ...]:
    """Coefficients `x >= 0` minimising the sum of `((row . x - y) / y) ** 2`: the
    unconstrained solution on each subset of the columns (the others held at 0), the best
    one whose coefficients are all non-negative. For the few columns the fits have."""
    if len(rows) != len(ys) or not rows or any(y <= 0 for y in ys):
        raise ValueError("least squares needs points with positive seconds")
    width = len(rows[0])
    scaled = [[v / y for v in row] for row, y in zip(rows, ys, strict=True)]
    best: tuple[float, tuple[float, ...]] | None = None
    for mask in range(1, 1 << width):
        cols = [j for j in range(width) if mask >> j & 1]
        x = _solve(
            [[sum(r[i] * r[j] for r in scaled) for j in cols] for i in cols],
            [sum(r[i] for r in scaled) for i in cols],
        )
        if x is None or min(x) < 0:
            continue
        full = [0.0] * width
        for j, v in zip(cols, x, strict=True):
            full[j] = v
        err = sum((sum(a * b for a, b in zip(r, full, strict=True)) - 1.0) ** 2 for r in scaled)
        if best is None or err < best[0] - 1e-15:
            best = (err, tuple(full))
    if best is None:
        raise ValueError("no non-negative fit")
    return best[1]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`a x = b` by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for i in range(n):
        pivot = max(range(i, n), key=lambda r: abs(m[r][i]))
        if abs(m[pivot][i]) <= 1e-12 * scale:
            return None
        m[i], m[pivot] = m[pivot], m[i]
        for r in range(i + 1, n):
            f = m[r][i] / m[i][i]
            for c in range(i, n + 1):
                m[r][c] -= f * m[i][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / m[i][i]
    return x


def gpu_cost(
    *,
    params: float,
    layers: int,
    attn_width: int,
    weight_bytes: float,
    kv_bytes_per_token: int,
    tp: int,
    peak_flops: float,
    mfu: float,
    hbm_bytes_per_s: float,
    hbm_efficiency: float,
    step_overhead_s: float,
    chunk_tokens: int,
) -> EngineCost:
    """An accelerator engine from its model's size and its GPUs' published figures.

    Dense layers: 2 FLOPs per parameter per token; attention: 4 FLOPs per (query, key)
    pair per unit of `attn_width` (heads x head_dim) per layer; both at `mfu` of the TP
    group's peak. A decode step reads the weights and each sequence's KV from HBM at
    `hbm_efficiency` of the group's bandwidth."""
    flops = peak_flops * mfu * tp
    bandwidth = hbm_bytes_per_s * hbm_efficiency * tp
    return EngineCost(
        step_s=step_overhead_s + weight_bytes / bandwidth,
        token_s=2.0 * params / flops,
        attn_s=4.0 * layers * attn_width / flops,
        decode_seq_s=2.0 * params / flops,
        decode_ctx_s=kv_bytes_per_token / bandwidth,
        chunk_tokens=chunk_tokens,
    )


@dataclass(frozen=True)
class Grid:
    """A calibration: the points the CPU engine's costs are fitted on."""

    prefill: tuple[tuple[int, int, float], ...]
    """(new tokens computed, cached tokens, seconds to the first output)."""
    decode: tuple[tuple[int, int, float], ...]
    """(sequences decoding, context tokens of each, seconds a step)."""
    source: str


def read_grid(path: str) -> Grid:
    """The points of a `bench.prefill_cost --grid` results file
    (`bench.sim.params.CPU_GRID_COMMAND`, whose decode batches give each sequence its own
    history), for a calibration on the day and VM of the run it is validated against
    (`--validate --grid FILE --run FILE`)."""
    import json

    with open(path) as f:
        plain = json.load(f)["results"]["plain"]
    prefill = tuple((p["new"], p["cached"], p["median_s"]) for p in plain["points"])
    decode = tuple((d["batch"], d["history"], d["step_s"]) for d in plain["decode"])
    return Grid(prefill, decode, path)
