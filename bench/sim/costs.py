"""Cost models of the simulated fleet: what one engine step, one KV transfer and one
Serve hop cost.

An engine (one vLLM engine, one tensor-parallel group) runs steps. A step carries the
sequences that are decoding (one token each) and up to `chunk_tokens` prompt tokens of
the requests waiting for prefill (chunked prefill, as vLLM's scheduler fills a step's
token budget: decodes first, then prefill chunks in arrival order). Its time is

    step_s + decode_seq_s * batch + decode_ctx_s * (context tokens the batch reads)
           + sum over prefill chunks of  new * (token_s + attn_s * (cached + new / 2))

`token_s` is the per-token cost of the dense layers, `attn_s` what a new token pays per
token of context it attends to (the context grows through a chunk, hence `new / 2`).
The same form serves the CPU engines (fitted from measured step and leg times) and the
GPU engines (derived from published FLOP and memory-bandwidth figures,
`bench.sim.params`). Pure functions; no simulation state.
"""

from __future__ import annotations

import math
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

    def prefill_s(self, new: int, cached: int = 0) -> float:
        """Compute time of `new` prompt tokens over `cached` tokens already in the cache."""
        if new <= 0:
            return 0.0
        return new * (self.token_s + self.attn_s * (cached + new / 2.0))

    def step(self, batch: int, context: int, chunks: Sequence[tuple[int, int]] = ()) -> float:
        """One step: `batch` sequences decoding over `context` tokens in all, and prefill
        `chunks` of (new, cached) tokens."""
        return (
            self.step_s
            + self.decode_seq_s * batch
            + self.decode_ctx_s * context
            + sum(self.prefill_s(n, c) for n, c in chunks)
        )

    def cold_prefill_s(self, tokens: int) -> float:
        """A whole prompt computed alone, chunk after chunk (each chunk a step)."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(self.chunk_tokens, tokens - done)
            total += self.step_s + self.prefill_s(n, done)
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


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks holding `tokens` positions."""
    return math.ceil(max(0, tokens) / block_size)


def fit_token_s(points: Sequence[tuple[int, int, float]], step_s: float, attn_ratio: float) -> float:
    """`token_s` that best fits measured single-request prefill legs, least squares.

    `points`: (new tokens, cached tokens, seconds) of legs measured alone; each leg is
    modelled as one step (`step_s`) plus its compute, with `attn_s = attn_ratio * token_s`:
    seconds - step_s = token_s * new * (1 + attn_ratio * (cached + new / 2))."""
    xs = [n * (1.0 + attn_ratio * (c + n / 2.0)) for n, c, _ in points]
    ys = [s - step_s for _, _, s in points]
    den = sum(x * x for x in xs)
    if den <= 0:
        raise ValueError("no calibration points with tokens")
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / den


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
