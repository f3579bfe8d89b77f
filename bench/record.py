"""`TurnRecord`: what the load generator (`bench.client`) measures of one turn, read by
the APIs' stream readers (`bench.apis`) and by every report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TurnRecord:
    """One measured request."""

    session: int
    turn: int  # 1-based
    kind: str
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0
    """Seconds since the mode's measured phase began."""
    ttft_s: float | None = None
    ttft_text_s: float | None = None
    """To the first decode step that carries text (comparable across APIs)."""
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks (one token per chunk in this app)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    reused_from_decode: int | None = None
    miss_reason: str | None = None
    decode_replica: str | None = None
    spliced: bool | None = None
    placement: str | None = None
    """Why the app computed the turn where it did (kvturn.placement: short, sooner, itl, ...)."""
    timings: dict | None = None
    """The app's breakdown of the turn (kvturn.timings): session_s, prefill_s, first_token_s."""
    finish_reason: str | None = None
    answer_chars: int = 0

    def as_dict(self) -> dict:
        return asdict(self)
