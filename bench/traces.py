"""Agent-trace-shaped workloads: a generator with the published shape parameters, and a
replay of a conversation trace file.

Published shapes this follows: Codex on SWE-bench Pro traces
(median 33 turns, input:output about 131:1, 94% of prompt tokens cacheable), Claude Code
sessions with subagents (median about 43 turns, more than 96% cacheable), tool results
from a few hundred to tens of thousands of tokens, pauses between turns.

A trace is shape only (token counts and times); `to_workload` renders it into the
benchmark's conversations (`bench.workload`) with seeded texts of those lengths.

`TraceShape` draws:

* sessions arriving as a Poisson process (`arrival_rate_per_s`);
* turns per session: log-normal around `turns_median` (`turns_sigma`), within
  `[turns_min, turns_max]`;
* each later turn a tool result (`tool_prob`) or a user message; tool results log-normal
  around `tool_median_tokens` with a heavy tail (`tool_sigma`), within
  `[tool_min_tokens, tool_max_tokens]`; user messages around `user_tokens`;
* answers log-normal around `answer_median_tokens`;
* pauses before later turns log-normal around `pause_median_s`;
* subagents: with `subagent_prob`, a session starts a child session at one of its turns;
  the child shares the parent's system prompt (a different task) and has its own turns.

The replay reads JSONL, one turn a line, in the shape aiperf and Mooncake traces use:

    {"session_id": "a", "timestamp": 0.0, "input_tokens": 5200, "output_tokens": 80}
    {"session_id": "a", "timestamp": 9.5, "input_tokens": 1400, "output_tokens": 40, "kind": "tool"}
    {"session_id": "b", "timestamp": 3.0, "input_tokens": 5000, "output_tokens": 60, "parent": "a"}

`timestamp` is seconds from the trace's start (`timestamp_ms`, milliseconds, is read
too); `input_tokens` is what the turn adds (the first turn's includes the system prompt,
`system_tokens` of it when given); `kind` is `user` or `tool` (default: `user` for a
session's first turn, `tool` after). A session's turns are sorted by time; the pause
before a turn is its timestamp less the previous turn's (the answer's time is not known
in advance, so a replay waits at least that long after the answer).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.stats import nearest_rank
from bench.workload import (
    _NAMES,
    SessionPlan,
    TokenCounter,
    TurnPlan,
    Workload,
    WorkloadSpec,
    prose,
    tool_output,
)


@dataclass(frozen=True)
class TraceTurn:
    kind: str  # "user" or "tool"
    tokens: int
    """Tokens the turn adds (a tool result or a user message)."""
    answer_tokens: int
    pause_s: float = 0.0
    """Seconds after the previous answer before this turn is sent."""


@dataclass(frozen=True)
class TraceSession:
    session_id: str
    start_s: float
    system_tokens: int
    turns: tuple[TraceTurn, ...]
    parent: str | None = None
    """The session this one is a subagent of: it shares that session's system prompt."""


@dataclass(frozen=True)
class Trace:
    sessions: tuple[TraceSession, ...]
    source: str = "generated"

    def renamed(self, prefix: str) -> Trace:
        """The same sessions with `prefix` before every session id (and parent): a trace
        whose sessions share nothing with another's (no cache, no handles)."""
        sessions = tuple(
            replace(s, session_id=prefix + s.session_id, parent=s.parent and prefix + s.parent)
            for s in self.sessions
        )
        return replace(self, sessions=sessions)

    def stats(self) -> dict:
        """The shape as measured: what a generator's parameters should be close to."""
        turns = [len(s.turns) for s in self.sessions]
        tools = [t.tokens for s in self.sessions for t in s.turns[1:] if t.kind == "tool"]
        prompt = cached = output = 0
        for s in self.sessions:
            history = s.system_tokens
            for i, t in enumerate(s.turns):
                prompt += history + t.tokens
                # Cacheable: the history a turn re-sends (everything but what it adds);
                # a subagent's first turn also finds its parent's system prompt cached.
                cached += history if i else (s.system_tokens if s.parent else 0)
                history += t.tokens + t.answer_tokens
                output += t.answer_tokens
        starts = sorted(s.start_s for s in self.sessions)
        pauses = [t.pause_s for s in self.sessions for t in s.turns[1:]]
        span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
        return {
            "sessions": len(self.sessions),
            "subagents": sum(1 for s in self.sessions if s.parent),
            "turns_median": nearest_rank(turns, 0.5),
            "tool_tokens_median": nearest_rank(tools, 0.5),
            "tool_tokens_p99": nearest_rank(tools, 0.99),
            "input_output_ratio": prompt / output if output else None,
            "cacheable_share": cached / prompt if prompt else None,
            "arrival_rate_per_s": (len(starts) - 1) / span if span else None,
            "pause_median_s": nearest_rank(pauses or [0.0], 0.5),
        }


@dataclass(frozen=True)
class TraceShape:
    """Parameters of a generated agent trace (defaults: a Codex-like coding agent, scaled
    to what a CPU engine serves: a 4k-token system prompt and 33 turns at the median)."""

    sessions: int = 16
    arrival_rate_per_s: float = 0.5
    turns_median: int = 33
    turns_sigma: float = 0.5
    turns_min: int = 2
    turns_max: int = 120
    system_tokens: int = 4000
    user_tokens: int = 120
    tool_prob: float = 0.85
    tool_median_tokens: int = 400
    tool_sigma: float = 1.1
    tool_min_tokens: int = 30
    tool_max_tokens: int = 20000
    answer_median_tokens: int = 40
    answer_sigma: float = 0.5
    pause_median_s: float = 1.0
    pause_sigma: float = 0.8
    subagent_prob: float = 0.15
    max_history_tokens: int | None = None
    """A session ends before a turn would take its history (prompt and answer) past this:
    the engines' context length, less room."""
    seed: int = 0
    notes: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.sessions < 1 or self.turns_median < 1 or not 1 <= self.turns_min <= self.turns_max:
            raise ValueError("sessions, turns_median >= 1 and 1 <= turns_min <= turns_max")
        if not (0 <= self.tool_prob <= 1 and 0 <= self.subagent_prob < 1):
            raise ValueError("tool_prob in [0, 1], subagent_prob in [0, 1)")
        if self.arrival_rate_per_s <= 0:
            raise ValueError("arrival_rate_per_s must be positive")

    def generate(self) -> Trace:
        rng = random.Random(f"kvturn-trace/{self.seed}")
        sessions: list[TraceSession] = []
        clock = 0.0
        n = 0
        while len(sessions) < self.sessions:
            if n:
                clock += rng.expovariate(self.arrival_rate_per_s)
            parent = TraceSession(f"t{n}", clock, self.system_tokens, self._turns(rng))
            n += 1
            sessions.append(parent)
            if len(sessions) < self.sessions and rng.random() < self.subagent_prob:
                # Started at one of the parent's turns: roughly when that turn is sent.
                at = rng.randrange(len(parent.turns))
                offset = sum(t.pause_s for t in parent.turns[: at + 1])
                child = TraceSession(
                    f"t{n}", clock + offset, self.system_tokens, self._turns(rng), parent.session_id
                )
                n += 1
                sessions.append(child)
        return Trace(tuple(sorted(sessions, key=lambda s: s.start_s)))

    def _turns(self, rng: random.Random) -> tuple[TraceTurn, ...]:
        count = _bounded(
            rng.lognormvariate(math.log(self.turns_median), self.turns_sigma), self.turns_min, self.turns_max
        )
        turns: list[TraceTurn] = []
        history = self.system_tokens
        for i in range(count):
            answer = max(1, round(rng.lognormvariate(math.log(self.answer_median_tokens), self.answer_sigma)))
            if i and rng.random() < self.tool_prob:
                size = rng.lognormvariate(math.log(self.tool_median_tokens), self.tool_sigma)
                turns.append(
                    TraceTurn(
                        "tool",
                        _bounded(size, self.tool_min_tokens, self.tool_max_tokens),
                        answer,
                        self._pause(rng),
                    )
                )
            else:
                turns.append(TraceTurn("user", self.user_tokens, answer, self._pause(rng) if i else 0.0))
            history += turns[-1].tokens + answer
            if self.max_history_tokens is not None and history > self.max_history_tokens and i:
                turns.pop()
                break
        return tuple(turns)

    def _pause(self, rng: random.Random) -> float:
        return (
            round(rng.lognormvariate(math.log(self.pause_median_s), self.pause_sigma), 3)
            if self.pause_median_s
            else 0.0
        )


def _bounded(value: float, low: int, high: int) -> int:
    return max(low, min(high, round(value)))


def read_trace(path: str | Path, system_tokens: int | None = None) -> Trace:
    """A conversation trace from JSONL (format in the module's docstring)."""
    rows: dict[str, list[dict]] = {}
    parents: dict[str, str] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            sid = str(row["session_id"])
            ts = float(row["timestamp"]) if "timestamp" in row else float(row["timestamp_ms"]) / 1000.0
            item = {
                "t": ts,
                "input": int(row["input_tokens"]),
                "output": int(row["output_tokens"]),
                "kind": row.get("kind"),
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a trace turn ({exc!r}): {line[:120]}") from None
        if item["input"] < 1 or item["output"] < 1 or item["kind"] not in (None, "user", "tool"):
            raise ValueError(f"{path}:{number}: tokens must be positive and kind user or tool")
        rows.setdefault(sid, []).append(item)
        if row.get("parent") is not None:
            parents[sid] = str(row["parent"])
    if not rows:
        raise ValueError(f"{path}: no turns")
    sessions = []
    for sid, items in rows.items():
        items.sort(key=lambda r: r["t"])
        first = items[0]
        system = min(system_tokens, first["input"] - 1) if system_tokens else max(1, first["input"] // 2)
        turns = [TraceTurn("user", max(1, first["input"] - system), first["output"])]
        for prev, cur in zip(items, items[1:], strict=False):
            kind = cur["kind"] or "tool"
            turns.append(
                TraceTurn(kind, cur["input"], cur["output"], round(max(0.0, cur["t"] - prev["t"]), 3))
            )
        sessions.append(TraceSession(sid, first["t"], system, tuple(turns), parents.get(sid)))
    start = min(s.start_s for s in sessions)
    shifted = [
        TraceSession(s.session_id, s.start_s - start, s.system_tokens, s.turns, s.parent)
        for s in sorted(sessions, key=lambda s: s.start_s)
    ]
    return Trace(tuple(shifted), source=str(path))


def write_trace(trace: Trace, path: str | Path) -> None:
    """The trace as JSONL (what `read_trace` reads back)."""
    lines = []
    for s in trace.sessions:
        t = s.start_s
        for i, turn in enumerate(s.turns):
            t += turn.pause_s if i else 0.0
            row = {
                "session_id": s.session_id,
                "timestamp": round(t, 3),
                "input_tokens": turn.tokens + (s.system_tokens if i == 0 else 0),
                "output_tokens": turn.answer_tokens,
                "kind": turn.kind,
            }
            if s.parent and i == 0:
                row["parent"] = s.parent
            lines.append(json.dumps(row))
    Path(path).write_text("\n".join(lines) + "\n")


def to_workload(trace: Trace, counter: TokenCounter, *, seed: int = 0, tag: str = "") -> Workload:
    """The trace as the benchmark's conversations: seeded texts of its lengths, one system
    prompt per family (a subagent uses its parent's), each session starting at its time.
    Answers are capped at each turn's `answer_tokens` (the workload's `answer_tokens` is the
    largest; `SessionPlan` turns carry their own)."""
    parents = {s.session_id: s.parent for s in trace.sessions}

    def family(session_id: str) -> str:
        seen = {session_id}
        while (up := parents.get(session_id)) is not None and up not in seen:
            seen.add(up)
            session_id = up
        return session_id

    systems: dict[str, str] = {}
    plans = []
    for index, s in enumerate(trace.sessions):
        root = family(s.session_id)
        if root not in systems:
            rng = random.Random(f"kvturn-trace/{seed}/{tag}/system/{root}")
            systems[root] = f"You are agent {root}{tag and ' ' + tag}. " + prose(
                rng, s.system_tokens, counter
            )
        rng = random.Random(f"kvturn-trace/{seed}/{tag}/session/{s.session_id}")
        turns = []
        for i, t in enumerate(s.turns):
            if t.kind == "tool":
                name = rng.choice(_NAMES)
                text = tool_output(rng, t.tokens, counter)
                message = {"role": "tool", "tool_call_id": f"call_{index}_{i}", "content": f"[{name}] {text}"}
                turns.append(TurnPlan("tool", (message,), t.tokens, t.pause_s, name, t.answer_tokens))
            else:
                text = f"Task {s.session_id}.{i}: " + prose(rng, t.tokens, counter)
                message = {"role": "user", "content": text}
                turns.append(TurnPlan("user", (message,), t.tokens, t.pause_s, None, t.answer_tokens))
        plans.append(SessionPlan(index, tuple(turns), s.start_s, systems[root]))
    first_system = next(iter(systems.values()))
    spec = WorkloadSpec(
        sessions=len(plans),
        turns=max(len(p.turns) for p in plans),
        concurrency=len(plans),
        system_tokens=max(s.system_tokens for s in trace.sessions),
        user_tokens=max((t.tokens for s in trace.sessions for t in s.turns if t.kind == "user"), default=1),
        tool_tokens=max((t.tokens for s in trace.sessions for t in s.turns if t.kind == "tool"), default=1),
        answer_tokens=max(t.answer_tokens for s in trace.sessions for t in s.turns),
        seed=seed,
    )
    return Workload(
        spec,
        first_system,
        tuple(plans),
        counter.exact,
        notes={"trace": trace.stats(), "source": trace.source},
    )
