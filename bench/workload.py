"""The agentic workload: seeded, deterministic conversations.

N sessions of T turns share one system prompt. Turn 1 is a user message; every later
turn appends the assistant's answer (the exact text the server returned) and then either
a user message or a long tool result. All texts are drawn from a seeded generator before
anything runs, so every mode sees the same conversations; only the answers come from the
server. Lengths are in tokens, measured with the model's tokenizer when one is at hand
(otherwise estimated from words).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Words the texts are drawn from: log lines, JSON, code and prose of the kind tools and
# users send. Mostly from the embedded tokenizer's training text, so they tokenise into
# few pieces.
_WORDS = (
    "the user asks about weather in Paris build status of repository and logs tool result "
    "status ok items path var log syslog lines def handler event context return statusCode "
    "body json dumps agents call tools many times every turn sends whole conversation to "
    "model quick brown fox jumps over lazy dog SELECT id name FROM users WHERE created_at "
    "now interval day ORDER BY error file not found warning deprecated option info retrying "
    "in seconds assistant helpful answer briefly use when they help"
).split()
_KEYS = ("status", "items", "path", "lines", "id", "name", "error", "info", "body", "event")
_NAMES = ("get_weather", "read_file", "run_query", "list_logs", "build_status")


class TokenCounter:
    """Counts tokens of a text with a Hugging Face tokenizer, or estimates from words."""

    WORDS_PER_TOKEN = 0.75  # estimate when no tokenizer is available

    def __init__(self, tokenizer_path: str | Path | None):
        self._tok = None
        if tokenizer_path is not None:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
            except Exception:  # no local tokenizer: estimate
                self._tok = None

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> int:
        if self._tok is None:
            return max(1, round(len(text.split()) / self.WORDS_PER_TOKEN))
        return len(self._tok.encode(text, add_special_tokens=False))


def _fit(words: list[str], target: int, counter: TokenCounter, sep: str = " ") -> str:
    """The longest prefix of `words` (joined by `sep`) with at most `target` tokens."""
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if counter.count(sep.join(words[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return sep.join(words[:lo])


def _pool(rng: random.Random, target: int, counter: TokenCounter, make) -> list[str]:
    """Enough pieces from `make(rng)` to exceed `target` tokens."""
    pieces: list[str] = []
    while True:
        pieces.extend(make(rng) for _ in range(max(8, target // 4)))
        if counter.count(" ".join(pieces)) > target:
            return pieces


def prose(rng: random.Random, tokens: int, counter: TokenCounter) -> str:
    """A user-style message of about `tokens` tokens."""
    return _fit(_pool(rng, tokens, counter, lambda r: r.choice(_WORDS)), tokens, counter)


def tool_output(rng: random.Random, tokens: int, counter: TokenCounter) -> str:
    """A tool-result-style text (JSON-ish records, log lines) of about `tokens` tokens."""

    def record(r: random.Random) -> str:
        if r.random() < 0.5:
            key, word = r.choice(_KEYS), r.choice(_WORDS)
            return f'{{"{key}": "{word}", "{r.choice(_KEYS)}": {r.randint(0, 9999)}}}'
        level = r.choice(("info", "warning", "error"))
        return f"{level}: {r.choice(_WORDS)} {r.choice(_WORDS)} {r.randint(0, 999)}"

    return _fit(_pool(rng, tokens, counter, record), tokens, counter)


@dataclass(frozen=True)
class WorkloadSpec:
    sessions: int = 2
    turns: int = 5
    concurrency: int = 2
    system_tokens: int = 600
    user_tokens: int = 200
    tool_tokens: int = 2200
    answer_tokens: int = 32
    tool_prob: float = 0.8
    """Chance that a later turn adds a tool result rather than a user message."""
    seed: int = 0
    tool_tokens_min: int | None = None
    """If set, each tool result's length is drawn uniformly from [tool_tokens_min,
    tool_tokens] (coding agents: many short results of varying size)."""
    pause_s: float = 0.0
    """Mean pause before each later turn (drawn uniformly from [0, 2 x pause_s]): a tool
    running, a user reading. The session's last turn stays pinned on decode meanwhile."""
    abandon_prob: float = 0.0
    """Chance that a session ends after each of its turns from the second on, without a
    word (its last turn stays pinned until the store lets it go)."""
    tool_calls: bool = False
    """The answer before a tool result goes back as the assistant's tool call (its text as
    the call's argument), as agent frameworks send it: the chat template renders it, so the
    history no longer repeats the generated text token for token."""

    def __post_init__(self):
        for name in (
            "sessions",
            "turns",
            "concurrency",
            "system_tokens",
            "user_tokens",
            "tool_tokens",
            "answer_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0.0 <= self.tool_prob <= 1.0:
            raise ValueError("tool_prob must be within [0, 1]")
        if self.tool_tokens_min is not None and not 1 <= self.tool_tokens_min <= self.tool_tokens:
            raise ValueError("tool_tokens_min must be within [1, tool_tokens]")
        if self.pause_s < 0:
            raise ValueError("pause_s must be at least 0")
        if not 0.0 <= self.abandon_prob < 1.0:
            raise ValueError("abandon_prob must be within [0, 1)")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TurnPlan:
    """What the client adds before a turn (after the previous answer, if any)."""

    kind: str  # "user" or "tool"
    messages: tuple[dict, ...]
    tokens: int
    """Tokens of the added content (template tokens not included)."""
    pause_s: float = 0.0
    """Seconds the client waits after the previous answer before sending this turn."""
    tool_name: str | None = None
    """Tool turns: the tool whose result this is (`tool_calls` workloads call it)."""
    answer_tokens: int | None = None
    """The answer's length for this turn (None: the workload's `answer_tokens`)."""


@dataclass(frozen=True)
class SessionPlan:
    index: int
    turns: tuple[TurnPlan, ...]
    start_s: float = 0.0
    """When the session starts, in seconds from the run's start (trace arrivals)."""
    system: str | None = None
    """Its own system prompt (None: the workload's shared one)."""


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    system: str
    sessions: tuple[SessionPlan, ...]
    exact_tokens: bool
    notes: dict = field(default_factory=dict)

    def summary(self) -> dict:
        kinds = [t.kind for s in self.sessions for t in s.turns[1:]]
        return {
            **self.spec.as_dict(),
            "exact_token_counts": self.exact_tokens,
            "later_turns_tool": kinds.count("tool"),
            "later_turns_user": kinds.count("user"),
            "planned_history_tokens": [
                sum(t.tokens for t in s.turns)
                + self.spec.system_tokens
                + self.spec.answer_tokens * (len(s.turns) - 1)
                for s in self.sessions
            ],
        }


def generate(spec: WorkloadSpec, counter: TokenCounter, *, tag: str = "") -> Workload:
    """The conversations for `spec`. Same spec, same tokenizer: same texts.

    `tag` makes a distinct workload with the same shape (used for warm-up traffic that
    must not share a prefix with the measured one)."""
    base = random.Random(f"kvturn-bench/{spec.seed}/{tag}/system")
    system = f"You are an agent{tag and ' ' + tag}. " + prose(base, spec.system_tokens, counter)
    sessions = []
    for s in range(spec.sessions):
        rng = random.Random(f"kvturn-bench/{spec.seed}/{tag}/session/{s}")
        # Drawn apart from the texts, so the same seed gives the same kinds at any length.
        kinds = random.Random(f"kvturn-bench/{spec.seed}/{tag}/kinds/{s}")
        # Pauses and abandonment from a stream of their own: texts and kinds stay the same.
        pacing = random.Random(f"kvturn-bench/{spec.seed}/{tag}/pacing/{s}")
        turns = []
        for t in range(spec.turns):
            if t >= 2 and pacing.random() < spec.abandon_prob:
                break  # the agent is gone after turn t
            pause = pacing.uniform(0.0, 2.0 * spec.pause_s) if t > 0 and spec.pause_s else 0.0
            if t > 0 and kinds.random() < spec.tool_prob:
                name = rng.choice(_NAMES)
                size = spec.tool_tokens
                if spec.tool_tokens_min is not None:
                    size = kinds.randint(spec.tool_tokens_min, spec.tool_tokens)
                text = tool_output(rng, size, counter)
                turns.append(
                    TurnPlan(
                        "tool",
                        ({"role": "tool", "tool_call_id": f"call_{s}_{t}", "content": f"[{name}] {text}"},),
                        counter.count(text),
                        pause,
                        name,
                    )
                )
            else:
                text = f"Task {s}.{t}: " + prose(rng, spec.user_tokens, counter)
                turns.append(
                    TurnPlan("user", ({"role": "user", "content": text},), counter.count(text), pause)
                )
        sessions.append(SessionPlan(s, tuple(turns)))
    return Workload(spec, system, tuple(sessions), counter.exact)
