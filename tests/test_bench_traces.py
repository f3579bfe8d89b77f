"""`bench.traces`: the generated shape matches its parameters, and traces replay."""

from __future__ import annotations

import json

import pytest

from bench.traces import Trace, TraceSession, TraceShape, TraceTurn, read_trace, to_workload, write_trace
from bench.workload import TokenCounter

TOLERANCE = 0.15
"""Generated medians and rates are within 15% of their parameters (over 400 sessions)."""


@pytest.fixture(scope="module")
def big():
    shape = TraceShape(sessions=400, arrival_rate_per_s=2.0, subagent_prob=0.2, seed=7)
    return shape, shape.generate()


def test_a_generated_trace_has_the_shape_it_was_asked_for(big):
    shape, trace = big
    stats = trace.stats()
    assert stats["sessions"] == 400
    assert abs(stats["turns_median"] / shape.turns_median - 1) <= TOLERANCE, stats
    assert abs(stats["tool_tokens_median"] / shape.tool_median_tokens - 1) <= TOLERANCE, stats
    # Sessions arrive at the asked rate; subagents start inside their parent's span.
    parents = stats["sessions"] - stats["subagents"]
    span = max(s.start_s for s in trace.sessions if not s.parent) - min(s.start_s for s in trace.sessions)
    assert abs((parents - 1) / span / shape.arrival_rate_per_s - 1) <= TOLERANCE, span
    assert abs(stats["subagents"] / parents - shape.subagent_prob) <= 0.05, stats
    pauses = sorted(t.pause_s for s in trace.sessions for t in s.turns[1:])
    assert abs(pauses[len(pauses) // 2] / shape.pause_median_s - 1) <= TOLERANCE


def test_tool_results_have_a_heavy_tail_and_the_published_ratios(big):
    shape, trace = big
    stats = trace.stats()
    tools = sorted(t.tokens for s in trace.sessions for t in s.turns if t.kind == "tool")
    assert tools[0] >= shape.tool_min_tokens and tools[-1] <= shape.tool_max_tokens
    assert stats["tool_tokens_p99"] >= 8 * stats["tool_tokens_median"]  # a few hundred to many thousands
    # Agent traces: input far above output, nearly all of it cacheable history.
    assert stats["input_output_ratio"] > 100
    assert stats["cacheable_share"] > 0.9


def test_subagents_share_their_parents_system_prompt(big):
    _, trace = big
    ids = {s.session_id for s in trace.sessions}
    children = [s for s in trace.sessions if s.parent]
    assert children and all(c.parent in ids for c in children)
    small = Trace(tuple(s for s in trace.sessions[:40]))
    workload = to_workload(small, TokenCounter(None), seed=1)
    by_id = {s.session_id: p for s, p in zip(small.sessions, workload.sessions, strict=True)}
    for child in (s for s in small.sessions if s.parent in by_id):
        assert by_id[child.session_id].system == by_id[child.parent].system
    starts = [p.start_s for p in workload.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_the_same_seed_gives_the_same_trace():
    assert TraceShape(sessions=20, seed=3).generate() == TraceShape(sessions=20, seed=3).generate()
    assert TraceShape(sessions=20, seed=3).generate() != TraceShape(sessions=20, seed=4).generate()


def test_a_trace_written_reads_back_the_same(tmp_path, big):
    _, trace = big
    small = Trace(trace.sessions[:30])
    path = tmp_path / "t.jsonl"
    write_trace(small, path)
    back = read_trace(path, system_tokens=TraceShape().system_tokens)
    assert [s.session_id for s in back.sessions] == [s.session_id for s in small.sessions]
    for a, b in zip(small.sessions, back.sessions, strict=True):
        assert b.parent == a.parent and b.system_tokens == a.system_tokens
        assert b.start_s == pytest.approx(a.start_s - small.sessions[0].start_s, abs=0.01)
        assert [(t.kind, t.tokens, t.answer_tokens) for t in b.turns] == [
            (t.kind, t.tokens, t.answer_tokens) for t in a.turns
        ]
        assert [t.pause_s for t in b.turns] == pytest.approx([t.pause_s for t in a.turns], abs=0.01)


def test_a_replayed_trace_keeps_times_kinds_and_lengths(tmp_path):
    rows = [
        {"session_id": "b", "timestamp_ms": 3000, "input_tokens": 900, "output_tokens": 20, "parent": "a"},
        {"session_id": "a", "timestamp": 0.0, "input_tokens": 1000, "output_tokens": 30},
        {"session_id": "a", "timestamp": 9.5, "input_tokens": 1400, "output_tokens": 40, "kind": "tool"},
        {"session_id": "a", "timestamp": 4.0, "input_tokens": 50, "output_tokens": 10, "kind": "user"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = read_trace(path, system_tokens=800)
    a, b = trace.sessions
    assert (a.session_id, a.start_s, a.system_tokens) == ("a", 0.0, 800)
    assert [(t.kind, t.tokens, t.answer_tokens, t.pause_s) for t in a.turns] == [
        ("user", 200, 30, 0.0),
        ("user", 50, 10, 4.0),
        ("tool", 1400, 40, 5.5),
    ]
    assert (b.session_id, b.start_s, b.parent) == ("b", 3.0, "a")
    workload = to_workload(trace, TokenCounter(None))
    assert [p.start_s for p in workload.sessions] == [0.0, 3.0]
    assert workload.sessions[1].system == workload.sessions[0].system
    assert [t.answer_tokens for t in workload.sessions[0].turns] == [30, 10, 40]


@pytest.mark.parametrize(
    "line",
    [
        '{"session_id": "a"}',
        '{"session_id": "a", "timestamp": 0, "input_tokens": 0, "output_tokens": 5}',
        "not json",
    ],
)
def test_a_bad_trace_line_is_named(tmp_path, line):
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_trace(path)


def test_turns_and_sessions_are_plain_values():
    turn = TraceTurn("tool", 10, 5, 0.5)
    session = TraceSession("x", 0.0, 100, (turn,))
    assert Trace((session,)).stats()["sessions"] == 1


def test_dp_is_two_single_engines_with_the_cores_of_one_pd_pair(tmp_path):
    from bench.__main__ import _modes
    from bench.apis import Api
    from bench.profiles import profile

    prof = profile("agentic")
    dp = prof.app_config("dp", str(tmp_path), "a")
    pd = prof.app_config("bidir", str(tmp_path), "a")
    assert dp.mode.value == "single" and dp.decode.num_replicas == 2
    assert dp.decode.num_cpus == pd.decode.num_cpus == pd.prefill.num_cpus
    assert _modes("dp,oneway,bidir", Api.CHAT) == ["dp", "oneway", "bidir"]
    assert _modes(None, Api.CHAT) == ["oneway", "bidir", "single"]


def test_histories_stay_within_the_context_asked_for():
    shape = TraceShape(sessions=50, tool_median_tokens=2000, max_history_tokens=12000, seed=2)
    for s in shape.generate().sessions:
        assert s.system_tokens + sum(t.tokens + t.answer_tokens for t in s.turns) <= 12000
        assert len(s.turns) >= 1


def test_the_long_fleet_profile_reaches_32k_histories_within_the_models_positions():
    from bench.fleet import LEVELS
    from bench.profiles import profile

    prof = profile("fleet-32k")
    assert prof.trace is not None and prof.name in LEVELS
    longest = max(
        s.system_tokens + sum(t.tokens + t.answer_tokens for t in s.turns)
        for s in prof.trace.generate().sessions
    )
    assert 16000 < longest <= 32000 <= prof.max_model_len
