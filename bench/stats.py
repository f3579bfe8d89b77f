"""Summary statistics the benchmarks share."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

BUCKETS = ((0, 2000), (2000, 4000), (4000, 8000), (8000, 16000), (16000, 1 << 30))
"""History buckets (prompt tokens) for the per-bucket TTFT tables."""


def bucket_name(low: int, high: int) -> str:
    """A history bucket's name in the tables: "2-4k", "16k+"."""
    return f"{low // 1000}k+" if high >= 1 << 30 else f"{low // 1000}-{high // 1000}k"


def mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 decimals; None when either is missing or b is 0."""
    return round(a / b, 3) if a is not None and b else None


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank quantile, q in [0, 1] (p90 of 10 values: the 9th smallest); None
    for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


SPANS = ("ttft", "prefill_engine", "decode_engine", "computed")
"""What `span_medians` summarises of a turn: its TTFT, its engines' spans (as
`app.api.metrics.turn_hops` names them) and the prompt tokens its engines computed."""


def span_medians(
    turns: Iterable[tuple[int, Mapping[str, float | None]]], edges: Sequence[tuple[int, int]] = BUCKETS
) -> dict[str, dict[str, float | None]]:
    """Per history bucket, the median of each of `SPANS` over the turns that have it;
    `turns`: (prompt tokens, its figures) pairs, a measured run's or a simulated one's."""
    turns = list(turns)
    out: dict[str, dict[str, float | None]] = {}
    for low, high in edges:
        group = [figures for prompt, figures in turns if low <= prompt < high]
        out[bucket_name(low, high)] = {
            name: nearest_rank([v for f in group if (v := f.get(name)) is not None], 0.5) for name in SPANS
        }
    return out
