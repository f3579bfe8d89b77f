"""The typed results of a turn's steps (`app.turn.turns.Turns.run`): where the turn is
computed (`Route`), the session step's `Session`, and the decode step's `Answer`, which
gathers the answer across decode replicas (restarts and continuations included)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from app.engines.wire import EngineChunk
from app.turn.legs import Continued, Output, Restart
from app.turn.model import Delta
from connector.records import Claim


class Route(enum.StrEnum):
    """Where a turn's prompt is computed."""

    LOCAL = "local"
    """On the session's decode replica, over the history it holds (the placement chose
    it): no prefill leg, no transfer."""
    PREFILL = "prefill"
    """P/D: a prefill leg computes the prompt (pulling the history from decode) and decode
    reads back what it lacks; if the leg is skipped, decode computes the prompt."""
    DECODE = "decode"
    """A decode replica computes the prompt (a deployment without prefill engines)."""


@dataclass(frozen=True)
class Session:
    """The session step's result: which conversation, and its claimed KV handle."""

    session_id: str
    prompt_ids: tuple[int, ...] | None
    """The prompt's ids if the step had to tokenize them (a prompt-token match)."""
    claim: Claim | None
    """The store's answer to `begin_turn` (None: no store, or it is unavailable)."""


@dataclass
class Answer:
    """The decode step's answer so far: what the client has been sent (or, for a turn that
    does not stream, is held until the end), over every replica that produced it."""

    stream: bool
    prompt_len: int
    on_decode: bool
    """The prompt is computed on decode (`Route.LOCAL`, `Route.DECODE`): its first chunk
    says how much of it was cached there."""
    cached: int
    """The prompt tokens not computed, when prefill computed the prompt."""
    generated: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    held: list[Delta] = field(default_factory=list)
    final: EngineChunk | None = None
    replica: str | None = None
    sent: bool = False
    """A delta reached the client: the answer can no longer start over."""
    announced: bool = False
    """The first delta (with the prompt tokens reused) was made."""
    recomputed: bool = False
    """Another replica started the answer over (`Restart`), computing the prompt itself."""
    continued: bool = False
    """Another replica went on with the answer (`Continued`)."""

    def can_restart(self) -> bool:
        return not self.sent

    def take(self, item: Output | Restart | Continued) -> Delta | None:
        """One item of `Legs.decode`; the delta to send now, if any."""
        if isinstance(item, Restart):
            # Another replica computes the prompt (and, if output had begun, the whole
            # answer) again: nothing of the failed attempt is kept.
            self.generated.clear()
            self.texts.clear()
            self.held.clear()
            self.final, self.recomputed, self.announced = None, True, False
            return None
        if isinstance(item, Continued):
            self.continued = True  # what was sent stays
            return None
        chunk, self.replica = item.chunk, item.replica
        self.generated.extend(chunk.token_ids)
        self.texts.append(chunk.text)
        if chunk.finished:
            self.final = chunk
        if not (chunk.token_ids or chunk.text):
            return None
        known = None
        if not self.announced:  # the answer's first delta says what was reused
            self.announced = True
            on_decode = self.recomputed or self.on_decode
            known = min(chunk.num_cached_tokens, self.prompt_len) if on_decode else self.cached
        delta = Delta(chunk.text, chunk.token_ids, chunk.logprobs, known)
        if not self.stream:
            self.held.append(delta)
            return None
        self.sent = True
        return delta

    @property
    def text(self) -> str:
        return "".join(self.texts)
