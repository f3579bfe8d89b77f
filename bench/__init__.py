"""kvturn's benchmarks: `python -m bench` (serving modes), `bench.soak`, `bench.store`,
`bench.prefill_cost`, `bench.sim`. They write their results under `RESULTS` unless told
otherwise (`--out`)."""

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"
"""`results/` at the repository root (not in the package; made on first write)."""


def settings(items: list[str], flag: str) -> dict[str, Any]:
    """`KEY=VALUE` items of a repeatable command-line `flag` (`--transfer`), each value read
    as JSON, else as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
