"""Summary statistics the benchmarks share."""

from __future__ import annotations

import math
import random
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


def share_over(values: Iterable[float], limit: float) -> float | None:
    """The share of `values` above `limit` (None for no values): of a level's output gaps,
    those past the ITL target, which its p99 allows 1% of."""
    xs = list(values)
    return sum(x > limit for x in xs) / len(xs) if xs else None


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


def paired_quantile_ratio(
    pairs: Sequence[tuple[float, float]], q: float, resamples: int = 2000, seed: int = 0
) -> tuple[float | None, float | None, float | None]:
    """The ratio of two modes' `q` quantiles over the same turns (`pairs`: (mine, the
    twin's) of each turn), and its 95% interval by resampling the turns (a paired
    bootstrap: both modes' quantiles over the same resampled turns); Nones for no pairs.
    How far a ratio of a level's few turns may move from run to run on the same load."""
    if not pairs:
        return None, None, None

    def at(sample: Sequence[tuple[float, float]]) -> float:
        a, b = nearest_rank((p[0] for p in sample), q), nearest_rank((p[1] for p in sample), q)
        assert a is not None and b
        return a / b

    rng = random.Random(seed)
    spread = sorted(at(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
    return at(pairs), spread[int(0.025 * resamples)], spread[int(0.975 * resamples) - 1]
