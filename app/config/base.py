"""What every config section shares: the strict base model, the serving mode, and where the
repository's models lie."""

from __future__ import annotations

import enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "default" / "tiny-qwen3"
"""`make run`'s model: the embedded tiny model whose answers end (`app.engines.default_model`)."""
OPEN_MODEL = REPO_ROOT / "models" / "tiny-qwen3"
"""The same weights with answers that run to `max_tokens`: the tests' and benchmarks'."""


class Mode(str, enum.Enum):
    BIDIR = "bidir"
    """P/D with KV reuse both ways: prefill pulls the history from decode each turn."""
    ONEWAY = "oneway"
    """Plain P/D: prefill recomputes the whole conversation every turn."""
    SINGLE = "single"
    """One engine per replica, prefix caching, session affinity, no transfer."""


class Strict(BaseModel):
    """A config section: unknown keys are errors, and a built config never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
