"""kvturn's benchmarks: `python -m bench` (serving modes), `bench.soak`, `bench.store`,
`bench.prefill_cost`, `bench.sim`. They write their results under `RESULTS` unless told
otherwise (`--out`)."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
"""`results/` at the repository root (not in the package; made on first write)."""
