"""`bench.elastic`: the downscale benchmark's summary and its app configs (no engines)."""

from __future__ import annotations

from bench.elastic import DOWN_AT, app_config, markdown, summarize
from bench.profiles import profile
from bench.record import TurnRecord


def rec(session: int, turn: int, ttft: float, replica: str, cached: int = 0, miss: str | None = None):
    return TurnRecord(
        session=session,
        turn=turn,
        kind="tool",
        ok=True,
        ttft_s=ttft,
        prompt_tokens=1000,
        cached_tokens=cached,
        miss_reason=miss,
        decode_replica=replica,
    )


def test_the_affected_sessions_are_those_the_removed_replica_answered_before_the_downscale():
    records = []
    for s, replica in ((0, "gone"), (1, "kept"), (2, "gone")):
        for t in range(1, DOWN_AT + 1):
            records.append(rec(s, t, 0.1, replica))
        # After the downscale every session is on the survivor; the affected ones recomputed.
        slow = replica == "gone"
        records.append(
            rec(
                s,
                DOWN_AT + 1,
                0.5 if slow else 0.1,
                "kept",
                0 if slow else 990,
                "replica_gone" if slow else None,
            )
        )
    out = summarize(records, {"gone"})
    assert out["affected_sessions"] == [0, 2] and out["errors"] == 0
    assert out["affected_steady_ttft_s"] == 0.1 and out["affected_next_ttft_s"] == 0.5
    assert out["next_vs_steady"] == 5.0 and out["next_vs_unaffected"] == 5.0
    assert out["affected_next_cached_share"] == 0.0
    assert out["affected_next_miss_reasons"] == ["replica_gone"]
    table = markdown([{"label": "no-migrate", "downscale_s": 9.5, **out}])
    assert "| no-migrate | 2 | 0.100 | 0.500 | 0.100 | 5.00 | 5.00 | 0.00 | replica_gone | 9.5 | 0 |" in table


def test_the_elastic_profile_holds_every_session_and_its_runs_differ_only_in_the_moves(tmp_path):
    prof = profile("elastic")
    spec = prof.workload
    assert spec.concurrency == spec.sessions and spec.turns > DOWN_AT
    on = app_config(prof, str(tmp_path), "a", migrate=True, decode_replicas=2)
    off = app_config(prof, str(tmp_path), "a", migrate=False, decode_replicas=1)
    assert (on.decode.num_replicas, on.drain.migrate) == (2, True)
    assert (off.decode.num_replicas, off.drain.migrate) == (1, False)
    assert on.mode.value == "bidir" and on.decode.num_cpus == 0.5
