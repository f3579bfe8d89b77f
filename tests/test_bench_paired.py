"""`bench.paired`: one mode's turns against their twins in another, by placement."""

import json

import pytest

from bench.paired import by_bucket, by_reason, compare, format_late, format_rows, tables
from bench.stats import paired_quantile_ratio


def turn(session, index, ttft, prompt=1500, cached=1000, placement=None, ok=True, itl=()):
    return {
        "itl_s": list(itl),
        "session": session,
        "turn": index,
        "ok": ok,
        "ttft_s": ttft,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "placement": placement,
    }


def test_twins_are_paired_by_session_and_turn_and_grouped_by_bucket_and_reason():
    mine = [
        turn(0, 1, 0.2, placement="short"),
        turn(0, 2, 0.6, prompt=2500, cached=2000, placement="itl"),
        turn(1, 1, 0.3, placement="short"),
        turn(1, 2, 0.9, prompt=2500, cached=2300, placement="itl"),
        turn(2, 1, 0.5, placement="short", ok=False),  # failed: left out
        turn(3, 1, 0.5, placement="short"),  # its twin's prompt differs: left out
    ]
    twins = [
        turn(0, 1, 0.1),
        turn(0, 2, 0.3, prompt=2500),
        turn(1, 1, 0.3),
        turn(1, 2, 0.3, prompt=2500),
        turn(2, 1, 0.1),
        turn(3, 1, 0.1, prompt=1400),
    ]
    rows = by_reason(mine, twins)
    groups = [(r["bucket"], r["reason"], r["turns"]) for r in rows]
    assert groups == [("0-2k", "short", 2), ("2-4k", "itl", 2)]
    short, itl = rows
    assert short["ratio_p50"] == pytest.approx(1.5)  # 2.0 and 1.0
    assert itl["ratio_p50"] == pytest.approx(2.5)  # 2.0 and 3.0
    assert itl["ttft_p50_s"] == pytest.approx(0.75) and itl["base_p50_s"] == pytest.approx(0.3)
    assert itl["computed_p50"] == 350  # 500 and 200 tokens computed


def test_the_level_is_the_highest_both_met_and_json_keys_read_alike():
    def level(agents, meets):
        return {"agents": agents, "meets_slo": meets}

    records = {4: [turn(0, 1, 0.2, placement="short")], 8: [turn(0, 1, 0.4, placement="itl")]}
    results = {
        "modes": {
            "bidir": {"levels": [level(4, True), level(8, True)], "records": records},
            "dp": {"levels": [level(4, True), level(8, False)], "records": {4: [turn(0, 1, 0.1)], 8: []}},
        }
    }
    agents, rows = compare(results)
    assert agents == 4 and rows[0]["reason"] == "short" and rows[0]["ratio_p50"] == pytest.approx(2.0)
    assert compare(json.loads(json.dumps(results))) == (agents, rows)  # keys are strings there
    assert compare(results, agents=8) == (8, [])  # dp has no turns there
    assert compare(results, base="oneway") == (None, [])
    assert "| 0-2k | short | 1 | 2.00 | 0.200 | 0.100 | 500 |" in format_rows(rows, "bidir", "dp", 4)


def test_buckets_give_each_quantile_ratio_with_an_interval_from_the_same_turns():
    mine = [turn(s, 1, 0.1 * (s + 1)) for s in range(10)] + [turn(s, 2, 0.5, prompt=2500) for s in range(10)]
    twins = [turn(s, 1, 0.1 * (s + 1)) for s in range(10)] + [
        turn(s, 2, 0.25, prompt=2500) for s in range(10)
    ]
    rows = by_bucket(mine, twins, long_tools=[[3, 2], [4, 2]])  # JSON gives lists
    assert [(r["bucket"], r["turns"]) for r in rows] == [("0-2k", 10), ("2-4k", 10), ("long_tool", 2)]
    same, twice, long = rows
    # The same TTFTs: every resample of the same turns gives 1.
    assert same["p50"] == (1.0, 1.0, 1.0) and same["p90"] == (1.0, 1.0, 1.0)
    assert twice["p90"] == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0))
    assert long["p50"][0] == pytest.approx(2.0)


def test_a_ratio_of_few_noisy_turns_has_a_wide_interval_and_many_a_narrow_one():
    import random

    rng = random.Random(1)

    def noisy(n):
        return [(rng.lognormvariate(0, 0.5), rng.lognormvariate(0, 0.5)) for _ in range(n)]

    few = paired_quantile_ratio(noisy(12), 0.9)
    many = paired_quantile_ratio(noisy(2000), 0.9)
    assert few[1] < few[0] < few[2] and many[1] <= many[0] <= many[2]
    assert few[2] - few[1] > 3 * (many[2] - many[1]) and many[2] - many[1] < 0.2
    assert paired_quantile_ratio([], 0.5) == (None, None, None)


def test_the_report_has_a_bucket_table_per_mode_against_dp():
    level = {"agents": 4, "meets_slo": True, "long_tools": [[0, 1]]}
    results = {
        "slo": {"itl_p99_s": 0.05},
        "modes": {
            m: {"levels": [level], "records": {4: [turn(0, 1, t)]}}
            for m, t in (("dp", 0.1), ("bidir", 0.2), ("dp-again", 0.1))
        },
    }
    text = "\n".join(tables(results))
    assert "bidir against dp at 4 agents" in text and "dp-again against dp at 4 agents" in text
    assert "bidir against dp-again at 4 agents" in text and "dp-again against dp-again" not in text
    assert "| 0-2k | 1 | 2.00 [2.00-2.00] | 2.00 [2.00-2.00] |" in text
    assert "| long_tool | 1 | 1.00 [1.00-1.00] | 1.00 [1.00-1.00] |" in text
    assert "| 0-2k | short |" not in text and "| 0-2k | - | 1 | 2.00 |" in text  # by placement: bidir only


def test_the_share_of_outputs_past_the_itl_target_is_counted_per_mode_from_the_records():
    results = {
        "slo": {"itl_p99_s": 0.05},
        "modes": {
            # dp: 2 of 100 gaps past 50 ms (a failed turn's are not counted); bidir: 1 of 200.
            "dp": {
                "levels": [],
                "records": {
                    4: [turn(0, 1, 0.1, itl=[0.01] * 98 + [0.06, 0.2]), turn(0, 2, 0.1, ok=False, itl=[1.0])]
                },
            },
            "bidir": {"levels": [], "records": {4: [turn(0, 1, 0.1, itl=[0.05] * 199 + [0.051])]}},
            "oneway": {"levels": [], "records": {4: []}},
        },
    }
    line = format_late(results, ("bidir", "dp", "oneway"), 4)
    assert "past the ITL target (50 ms) at 4 agents" in line
    assert "bidir 0.50%, dp 2.00%, oneway -." in line
