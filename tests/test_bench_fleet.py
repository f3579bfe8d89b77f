"""`bench.fleet`: goodput at a latency target from synthetic records (no engines)."""

from __future__ import annotations

import pytest

from bench.fleet import SLO, buckets, goodput, level_stats, markdown, ratios
from bench.record import TurnRecord


def rec(session: int, turn: int, ttft: float, prompt: int = 1000, itl: float = 0.05, ok: bool = True):
    return TurnRecord(
        session=session, turn=turn, kind="tool", ok=ok, ttft_s=ttft, prompt_tokens=prompt, itl_s=[itl] * 10
    )


def test_a_level_meets_the_target_by_ttft_p90_and_itl_p99_and_no_error():
    slo = SLO(ttft_p90_s=1.0, itl_p99_s=0.2)
    fast = [rec(0, t, 0.5) for t in range(1, 11)]
    lv = level_stats(fast, 5.0, slo)
    assert lv["meets_slo"] and lv["turns"] == 10 and lv["turns_per_s"] == 2.0 and lv["ttft_p90_s"] == 0.5
    # One slow turn in ten is within p90; two are not.
    assert level_stats([*fast[:9], rec(0, 10, 3.0)], 5.0, slo)["meets_slo"]
    assert not level_stats([*fast[:8], rec(0, 9, 3.0), rec(0, 10, 3.0)], 5.0, slo)["meets_slo"]
    assert not level_stats([rec(0, t, 0.5, itl=0.3) for t in range(1, 11)], 5.0, slo)["meets_slo"]
    assert lv["itl_late_share"] == 0.0
    assert level_stats([*fast[:9], rec(0, 10, 0.5, itl=0.3)], 5.0, slo)["itl_late_share"] == 0.1
    assert not level_stats([*fast, rec(0, 11, 0.1, ok=False)], 5.0, slo)["meets_slo"]


def test_goodput_is_the_best_rate_among_levels_that_meet_the_target():
    levels = [
        {"agents": 2, "turns_per_s": 1.0, "meets_slo": True},
        {"agents": 4, "turns_per_s": 1.8, "meets_slo": True},
        {"agents": 8, "turns_per_s": 2.5, "meets_slo": False},
    ]
    assert goodput(levels) == {"agents": 4, "turns_per_s": 1.8}
    assert goodput([{**lv, "meets_slo": False} for lv in levels]) is None


def test_buckets_split_ttft_by_history_and_long_tool_results():
    records = [
        rec(0, 1, 0.1, prompt=500),
        rec(0, 2, 0.3, prompt=2500),
        rec(1, 1, 0.9, prompt=9000),
        rec(1, 2, 1.5, prompt=30000),
    ]
    out = buckets(records, long_tools={(0, 2)})
    assert out["0-2k"]["turns"] == 1 and out["2-4k"]["ttft_p50_s"] == 0.3
    assert out["8-16k"]["ttft_p90_s"] == 0.9
    assert out["16k+"] == {"turns": 1, "ttft_p50_s": 1.5, "ttft_p90_s": 1.5}
    assert out["4-8k"]["turns"] == 0 and out["4-8k"]["ttft_p50_s"] is None
    assert out["long_tool"] == {"turns": 1, "ttft_p50_s": 0.3, "ttft_p90_s": 0.3}


def _run(rate_2: float, rate_4: float, meets_4: bool, itl: float, ttft: float) -> dict:
    b = {
        "0-2k": {"ttft_p50_s": ttft, "ttft_p90_s": ttft * 3},
        "long_tool": {"ttft_p50_s": ttft * 2, "ttft_p90_s": ttft * 4},
    }
    levels = [
        {"agents": 2, "turns_per_s": rate_2, "meets_slo": True, "itl_p99_s": itl, "buckets": b},
        {"agents": 4, "turns_per_s": rate_4, "meets_slo": meets_4, "itl_p99_s": itl, "buckets": b},
    ]
    return {"levels": levels, "goodput": goodput(levels)}


def test_ratios_of_bidir_against_dp_and_oneway():
    modes = {
        "bidir": _run(1.0, 2.0, True, 0.1, 0.2),
        "dp": _run(1.0, 1.6, False, 0.2, 0.2),
        "oneway": _run(0.5, 0.8, False, 0.1, 0.8),
    }
    r = ratios(modes)
    assert r["goodput_bidir_over_dp"] == 2.0 and r["goodput_bidir_over_oneway"] == 4.0
    assert r["itl_p99_bidir_over_dp_at_4"] == 0.5
    assert r["ttft_p50_bidir_over_oneway_by_bucket_at_4"] == {"0-2k": 0.25, "long_tool": 0.25}
    # At the highest level both met (2: dp and oneway miss at 4).
    assert r["ttft_p90_bidir_over_oneway_by_bucket_at_2_met"] == {"0-2k": 0.25, "long_tool": 0.25}
    assert r["ttft_p50_bidir_over_dp_by_bucket_at_2_met"] == {"0-2k": 1.0, "long_tool": 1.0}
    assert not any(k.endswith("_at_4_met") for k in r)
    table = markdown(
        {
            "slo": {"ttft_p90_s": 2.0, "itl_p99_s": 0.5},
            "modes": {
                m: {
                    **run,
                    "levels": [
                        {**lv, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "engine_tokens_computed": 5, "errors": 0}
                        for lv in run["levels"]
                    ],
                }
                for m, run in modes.items()
            },
            "ratios": r,
        }
    )
    assert "| bidir | 4 | 2.000 |" in table and "| dp | 2.000 |" not in table
    assert "TTFT p50 (s) by history at 4 agents" in table and "| oneway | 0.800 | 1.600 |" in table


def test_every_bidir_mode_is_compared_and_a_ramp_stops_at_the_first_miss():
    modes = {"bidir-pd": _run(1.0, 2.4, True, 0.1, 0.2), "dp": _run(1.0, 1.6, True, 0.2, 0.2)}
    r = ratios(modes)
    assert r["goodput_bidir-pd_over_dp"] == 1.5 and "goodput_bidir_over_dp" not in r
    from bench.fleet import LEVELS, ramp

    assert LEVELS["fleet"] == tuple(sorted(LEVELS["fleet"]))  # ramps go up
    assert ramp("fleet") == LEVELS["fleet"]
    assert ramp("fleet", max_agents=8) == (4, 8) and ramp("fleet", max_agents=10) == (4, 8)
    assert ramp("fleet-gpu", max_agents=2) == (4,)  # the first level runs whatever the cap


def test_long_tool_results_are_split_by_where_they_were_computed_and_placements_counted():
    from bench.fleet import long_tool_hops, placements

    local = rec(0, 2, 0.3)
    local.timings = {"store_s": 0.01, "session_s": 0.02, "first_token_s": 0.28, "decode_engine_s": 0.25}
    local.placement = "sooner"
    hop = rec(1, 2, 0.5)
    hop.timings = {
        "store_s": 0.01,
        "session_s": 0.02,
        "prefill_engine_s": 0.3,
        "prefill_s": 0.35,
        "decode_engine_s": 0.05,
        "first_token_s": 0.45,
    }
    hop.placement = "itl"
    short = rec(1, 3, 0.1)  # not a long tool result
    short.placement = "short"
    out = long_tool_hops([local, hop, short], long_tools={(0, 2), (1, 2)})
    assert out["decode"]["turns"] == 1 and out["decode"]["ttft_s"] == 0.3
    assert out["decode"]["hops"]["decode_engine"] == 0.25 and "prefill_engine" not in out["decode"]["hops"]
    assert out["prefill"]["hops"]["prefill_engine"] == 0.3
    assert out["prefill"]["hops"]["prefill_transport"] == pytest.approx(0.03)
    assert out["prefill"]["hops"]["decode_transport"] == pytest.approx(0.05)
    assert placements([local, hop, short]) == {"itl": 1, "short": 1, "sooner": 1}
