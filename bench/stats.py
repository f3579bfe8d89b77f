"""Summary statistics the benchmarks share."""

from __future__ import annotations

import math
from collections.abc import Iterable


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
