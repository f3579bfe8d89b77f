"""`bench.sim.fleet` and `bench.sim.policy`: the simulated fleet's bookkeeping (every turn
answered, tokens computed where they should be, pinned blocks within the app's budget,
engines empty at the end), and the app's own decisions driven by simulated time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.turn.pacing import LateTokens
from bench.sim import policy
from bench.sim.fleet import MODES, Fleet, FleetSpec, PrefixCache
from bench.sim.params import EFA_BYTES_PER_S_PER_GPU, GPU_NIXL_LATENCY_S, cpu_fleet, gpu_qwen3_32b
from bench.sim.study import level_figures, level_trace, warmup_trace, weighted_quantile
from bench.traces import Trace, TraceSession, TraceShape, TraceTurn

SHAPE = TraceShape(
    sessions=6,
    arrival_rate_per_s=2.0,
    turns_median=5,
    turns_max=8,
    system_tokens=800,
    tool_median_tokens=300,
    tool_max_tokens=3000,
    answer_median_tokens=20,
    pause_median_s=0.5,
    max_history_tokens=8000,
    seed=3,
)


def _run(mode: str, trace: Trace, **spec):
    fleet = Fleet(FleetSpec(mode, cpu_fleet(), **spec))
    return fleet, fleet.run(trace)


@pytest.mark.parametrize("mode", MODES)
def test_every_turn_is_answered_and_the_engines_end_empty(mode):
    trace = SHAPE.generate()
    fleet, run = _run(mode, trace, decode=2 if mode == "dp" else 1)
    assert len(run.turns) == sum(len(s.turns) for s in trace.sessions)
    # The TTFT counts the ingress's own work (`ingress_s`) past the engine's first token.
    first = [t.start_s + t.ttft_s - fleet.spec.hw.ingress_s for t in run.turns]
    assert all(t.ttft_s > 0 and t.end_s >= at - 1e-9 for t, at in zip(run.turns, first, strict=True))
    engines = fleet.prefill + fleet.decode
    assert all(e.idle() and e.blocks_in_use == 0 and e.queued_tokens == 0 for e in engines)
    # What the turns say they computed is what the engines computed.
    assert sum(t.computed_tokens for t in run.turns) == run.computed_tokens
    answers = sum(t.answer_tokens for s in trace.sessions for t in s.turns)
    assert sum(e.stats.decoded_tokens for e in engines) == answers  # bidir-host: prefill's hosted turns


@pytest.mark.parametrize("mode", MODES)
def test_each_level_starts_cold_as_the_benchmarks_do(mode):
    # The benchmark gives every level (and the warm-up) its own system prompts: a level's
    # first turns find nothing of the level before in the caches or the store.
    fleet = Fleet(FleetSpec(mode, cpu_fleet(), decode=2 if mode == "dp" else 1))
    fleet.run(warmup_trace(SHAPE))
    fleet.run(level_trace(SHAPE, 2))
    run = fleet.run(level_trace(SHAPE, 4))
    firsts = [t for t in run.turns if t.turn == 1]
    assert len(firsts) == 4
    assert all(t.computed_tokens == t.prompt_tokens for t in firsts)
    assert all(t.route in ("single", "prefill-recompute") or t.route.startswith("local") for t in firsts)


def test_renamed_traces_share_no_session():
    trace = SHAPE.generate()
    a, b = trace.renamed("a/"), trace.renamed("b/")
    ids = {s.session_id for s in a.sessions}
    assert len(ids) == len(trace.sessions) and not ids & {s.session_id for s in b.sessions}
    assert [s.turns for s in a.sessions] == [s.turns for s in trace.sessions]
    assert all(s.parent is None or s.parent in ids for s in a.sessions)


def test_prompts_follow_the_trace():
    trace = SHAPE.generate()
    _, run = _run("oneway", trace)
    by_turn = {(t.session, t.turn): t for t in run.turns}
    for s in trace.sessions:
        history = s.system_tokens
        for i, turn in enumerate(s.turns):
            assert by_turn[(s.session_id, i + 1)].prompt_tokens == history + turn.tokens
            history += turn.tokens + turn.answer_tokens


def test_reuse_computes_less_than_oneway():
    trace = SHAPE.generate()
    prompts = sum(t.prompt_tokens for t in _run("oneway", trace)[1].turns)
    assert _run("oneway", trace)[1].computed_tokens == prompts  # recomputes every prompt
    for mode in ("bidir", "bidir-pd"):
        _, run = _run(mode, trace)
        assert run.computed_tokens < prompts / 2
        # Every later turn found its history (nothing evicted at this size).
        assert all(t.route != "prefill-recompute" for t in run.turns if t.turn > 1)


def test_a_history_is_found_in_whole_blocks_and_its_partial_block_computed():
    hw = cpu_fleet()
    trace = SHAPE.generate()
    for mode in ("dp", "bidir-pd"):
        _, run = _run(mode, trace)
        later = [t for t in run.turns if t.turn > 1]
        # vLLM's prefix cache and NIXL hold full blocks: a turn computes what it adds plus
        # the tail of its history past the last full block, never less, never a block more.
        assert all(0 <= t.computed_tokens - t.tokens < hw.block_size for t in later)
        assert any(t.computed_tokens > t.tokens for t in later)
    cache = PrefixCache(1000, block_size=16)
    cache.insert("s", 100, 0)
    assert cache.hit("s") == 96 and cache.hit("other") == 0


def test_bidir_pd_never_computes_on_decode():
    _, run = _run("bidir-pd", SHAPE.generate())
    assert {t.route for t in run.turns} <= {"prefill", "prefill-recompute"}
    # Its decode engine's steps only decode; dp's engines compute prompts between streams.
    decode = run.engine_steps["DecodeServer"]
    assert decode is not None and decode["prompt_share"] == 0 and decode["prompt_s"] is None
    _, dp = _run("dp", SHAPE.generate(), decode=2)
    assert set(dp.engine_steps) == {"DecodeServer"}
    steps = dp.engine_steps["DecodeServer"]
    assert steps is not None and 0 < steps["prompt_share"] < 1 and steps["prompt_s"] > steps["decode_s"]


def test_a_roles_steps_are_figured_from_the_counters_the_apps_replicas_report():
    """`bench.fleet.step_figures`: what the study prints per role and level, from the
    counters the app's replicas report and the simulation's engines keep alike."""
    from bench.fleet import step_figures

    counters = {
        "engine_busy_steps": 100,
        "engine_busy_step_s": 1.4,
        "engine_prompt_steps": 4,
        "engine_prompt_step_s": 0.44,
        "engine_busy_step_seqs": 250,
    }
    assert step_figures(counters) == {
        "mean_s": 0.014,
        "decode_s": 0.01,
        "prompt_s": 0.11,
        "prompt_share": 0.04,
        "batch": 2.5,
    }
    assert step_figures({**counters, "engine_busy_steps": 0}) is None


def test_pins_stay_within_the_apps_budget():
    hw = replace(cpu_fleet(), kv_blocks=400)
    fleet = Fleet(FleetSpec("bidir", hw))
    run = fleet.run(replace(SHAPE, sessions=12).generate())
    assert fleet.store is not None
    budget = policy.config.SessionConfig().pinned_fraction * hw.kv_blocks
    assert 0 < run.peak_pinned_blocks
    assert fleet.store.pinned_blocks("d0") <= budget
    assert fleet.store.counts["evicted_for_blocks"] > 0
    # Evicted conversations recompute through prefill.
    assert any(t.route == "prefill-recompute" and t.turn > 1 for t in run.turns)


def test_a_prefill_replica_hosts_sessions_then_hands_them_to_decode():
    # Sessions one after another: an idle fleet, where the prefill replica hosts some.
    fleet, run = _run("bidir-host", replace(SHAPE, arrival_rate_per_s=0.2).generate())
    hosted = [t for t in run.turns if t.route == "local:hosted"]
    assert hosted and run.placements["hosted"] == len(hosted)
    assert fleet.prefill[0].stats.decoded_tokens > 0
    # Streams on the prefill replica come late once its legs stretch its steps: every
    # session it hosts then goes to decode through a leg over the history it caches.
    late = replace(SHAPE, sessions=16, arrival_rate_per_s=8.0)
    fleet, run = _run(
        "bidir-host", late.generate(), placement="priced", transfer=(("itl_late_fraction", 0.0),)
    )
    handed = [t for t in run.turns if t.route == "handoff"]
    assert handed and all(t.computed_tokens < t.prompt_tokens for t in handed)  # its cache held the history
    assert fleet.store is not None and fleet.store.stats()["open_leases"] == 0


def test_store_settles_every_claim():
    fleet, run = _run("bidir", SHAPE.generate())
    assert fleet.store is not None
    stats = fleet.store.stats()
    assert stats["counts"].get("claimed", 0) == sum(1 for t in run.turns if t.turn > 1)
    assert stats["open_leases"] == 0


def test_placement_is_the_apps():
    transfer = policy.transfer_config(placement="static")
    state = policy.PlacementState(lambda: 0.0, transfer, 0)
    assert state.place(transfer.decode_local_tokens, None) == "short"
    assert state.place(transfer.decode_local_tokens + 1, "d0") is None  # prefill idle
    pd = policy.PlacementState(
        lambda: 0.0, policy.transfer_config(decode_local_tokens=0, decode_local_busy_tokens=0), 0
    )
    assert pd.place(1, "d0") is None


def test_placement_reads_the_apps_paces_as_the_ingress_does(monkeypatch):
    """`place` gets prefill's and the replica's (fixed, per token, per token of context)
    fits, the turn's history and the replica's late budget, as `Turns._placement_of`
    builds them."""
    now = [0.0]
    state = policy.PlacementState(lambda: now[0], policy.transfer_config(), 256)
    for i in range(12):  # legs of 100-1,200 tokens at 0.2 s + 0.1 ms a token + 50 ns per context token
        tokens, context = 100 + 100 * i, (i % 4) * 2000
        end = state.prefill_leg(tokens, context)
        now[0] += 0.2 + 1e-4 * tokens + 5e-8 * tokens * context
        end(tokens)
    seen = []
    real = policy.placement.place
    monkeypatch.setattr(policy.placement, "place", lambda *a: seen.append(a) or real(*a))
    state.place(100, "d0", 3000)
    _, prefill, decode, limits, context = seen[-1]
    assert prefill.fixed_s == pytest.approx(0.2, rel=1e-6)
    assert prefill.seconds_per_token == pytest.approx(1e-4, rel=1e-6)
    assert prefill.seconds_per_context == pytest.approx(5e-8, rel=1e-6)
    assert context == 3000
    assert decode.late_budget == state.streams.of("d0").late.budget
    assert limits.chunk_tokens == 256


def test_late_outputs_spend_the_streams_budget():
    transfer = policy.transfer_config()
    state = policy.PlacementState(lambda: 0.0, transfer, 256)
    state.streams.of("d0").streams = 1
    assert state.place(transfer.decode_local_tokens, "d0") == "short"
    state.outputs("d0", [2 * transfer.itl_target_ms / 1000], 50)  # 50 late outputs
    assert state.streams.of("d0").late.budget < 0
    assert state.place(transfer.decode_local_tokens, "d0") is None  # through prefill (itl)
    state.outputs("d0", [0.5 * transfer.itl_target_ms / 1000], 100_000)  # on time since
    assert state.streams.of("d0").late.budget > 0
    assert state.place(transfer.decode_local_tokens, "d0") == "short"


def test_the_engines_report_their_streams_to_placement():
    fleet, run = _run("bidir", SHAPE.generate())
    streams = fleet.placement.streams.of("d0")
    answers = sum(t.answer_tokens for s in SHAPE.generate().sessions for t in s.turns)
    assert 0 < streams.late.seen <= answers
    assert streams.seconds_per_token.value is not None and streams.streams == 0


def test_a_new_session_is_priced_on_the_least_loaded_replica():
    state = policy.PlacementState(lambda: 0.0, policy.transfer_config(), 256)
    state.streams.of("d0").streams = 2
    state.streams.of("d1").streams = 1
    assert state.least_loaded(["d0", "d1"]) == "d1"
    state.local_pace("d1").tokens_in_flight = 300
    state.streams.of("d1").streams = 2
    assert state.least_loaded(["d0", "d1"]) == "d0"
    # Under the priced rule, short first turns stay on decode and spread over both.
    trace = replace(SHAPE, sessions=8, system_tokens=100, tool_median_tokens=100).generate()
    # Engines on cores of their own: no stream comes late, so no budget sends one through prefill.
    fleet = Fleet(FleetSpec("bidir", replace(cpu_fleet(), cores=0.0), decode=2))
    run = fleet.run(trace)
    firsts = [t for t in run.turns if t.turn == 1]
    assert all(t.route == "local:short" for t in firsts if t.prompt_tokens <= 512)
    assert {e.name for e in fleet.decode if e.stats.computed_tokens} == {"d0", "d1"}


def test_gpu_turn_through_prefill_pays_the_pull():
    turns = (TraceTurn("user", 20_000, 50), TraceTurn("user", 150, 50, pause_s=1.0))
    trace = Trace((TraceSession("a", 0.0, 500, turns),))
    hw = gpu_qwen3_32b(tp=8, mfu=0.4)
    ttft = {}
    for mode in ("oneway", "bidir-pd"):
        run = Fleet(FleetSpec(mode, hw)).run(trace)
        ttft[mode] = run.turns[1].ttft_s
    pull = hw.link.transfer_s(20_500 + 50, hw.kv_bytes_per_token)
    assert ttft["bidir-pd"] > pull
    assert ttft["oneway"] > ttft["bidir-pd"]


def test_weighted_quantile_and_level_figures():
    assert weighted_quantile([(1.0, 98), (5.0, 2)], 0.99) == 5.0
    assert weighted_quantile([(1.0, 99), (5.0, 1)], 0.99) == 1.0
    assert weighted_quantile([], 0.5) is None
    from bench.fleet import SLO

    _, run = _run("bidir", SHAPE.generate())
    figures = level_figures(run, SLO())
    assert figures["turns"] == len(run.turns) and figures["turns_per_s"] > 0
    assert sum(figures["routes"].values()) == len(run.turns)


def test_a_level_runs_its_sessions_as_many_at_once_as_it_has_agents():
    """`--level-sessions`: three sessions per agent, at most `agents` of them at once (the
    benchmark's client concurrency); each later one starts as one ends."""
    trace = level_trace(SHAPE, 2, sessions_per_agent=3)
    assert len(trace.sessions) == 6
    fleet = Fleet(FleetSpec("bidir", cpu_fleet()))
    run = fleet.run(trace, concurrency=2)
    assert len(run.turns) == sum(len(s.turns) for s in trace.sessions)
    spans = []
    for s in trace.sessions:
        mine = [t for t in run.turns if t.session == s.session_id]
        spans.append((min(t.start_s for t in mine), max(t.end_s for t in mine)))
    starts = sorted(a for a, _ in spans)
    assert all(sum(1 for a, b in spans if a <= start < b) <= 2 for start in starts)
    # A session that arrived while two ran started when one of them ended.
    late = [(a, s) for (a, _), s in zip(spans, trace.sessions, strict=True) if a > s.start_s + 1e-9]
    assert late and all(any(abs(a - end) < 1e-9 for _, end in spans) for a, _ in late)
    uncapped = Fleet(FleetSpec("bidir", cpu_fleet())).run(trace)
    assert max(t.start_s for t in uncapped.turns if t.turn == 1) < max(starts)


def test_the_study_compares_the_default_with_dp_where_both_meet(capsys):
    from bench.fleet import SLO
    from bench.sim.study import buckets, default_over_dp, format_compare

    _, run = _run("bidir", SHAPE.generate())
    groups = buckets(run)
    assert sum(g["turns"] for name, g in groups.items() if name != "long_tool") == len(run.turns)
    assert all(g["ttft_p90_s"] >= g["ttft_p50_s"] for g in groups.values() if g["turns"])

    def level(agents, meets, p50):
        return {
            "agents": agents,
            "meets_slo": meets,
            "buckets": {
                "0-2k": {"ttft_p50_s": p50, "ttft_p90_s": 2 * p50},
                "8-16k": {"ttft_p50_s": None, "ttft_p90_s": None},
            },
        }

    result = {
        "dp": {"levels": [level(4, True, 0.1), level(8, False, 0.2)]},
        "bidir": {"levels": [level(4, True, 0.12), level(8, True, 0.3)]},
    }
    assert default_over_dp(result) == [
        {"agents": 4, "0-2k p50": 1.2, "0-2k p90": 1.2, "8-16k p50": None, "8-16k p90": None}
    ]
    shape = replace(SHAPE, sessions=2, turns_median=2, turns_max=2)
    from bench.sim.study import compare

    compared = compare(cpu_fleet(), shape)
    assert set(compared) == {"dp", "bidir", "bidir-host", "bidir-pd"}
    text = format_compare(compared)
    assert "goodput" in text and "| dp | 4 |" in text
    assert all(
        lv["meets_slo"]
        == (lv["ttft_p90_s"] <= SLO().ttft_p90_s and (lv["itl_p99_s"] or 0) <= SLO().itl_p99_s)
        for run in compared.values()
        for lv in run["levels"]
    )


def test_the_study_runs_from_the_command_line_with_the_profiles_kv(tmp_path, capsys):
    import json

    from bench.sim.__main__ import main

    out = tmp_path / "study.json"
    assert main(["--study", "--profile", "fleet-32k", "--cores", "0", "--out", str(out)]) == 0
    assert "goodput (turns/s)" in capsys.readouterr().out
    study = json.loads(out.read_text())["study"]
    assert study["profile"] == "fleet-32k" and study["cores"] == 0
    assert set(study["modes"]) == {"dp", "bidir", "bidir-host", "bidir-pd"}
    assert all(lv["agents"] in (4, 8, 16) for run in study["modes"].values() for lv in run["levels"])


def test_the_serving_paths_jitter_reaches_the_client_and_the_late_budget():
    """The same engines' steps, seen through the CPU VM's jitter: the ITL tail grows, the
    outputs' total stays, and the ingress's late count (which the placement spends) sees
    the late ones; the engines' own timing does not change."""
    trace = SHAPE.generate()
    longest = max(
        g for g, _ in Fleet(FleetSpec("bidir-pd", replace(cpu_fleet(), itl_jitter=()))).run(trace).itl
    )
    # A target whose late mark is half as long again as the longest step: no step is late,
    # some outputs seen through the jitter (up to 3x a step) are.
    target = (("itl_target_ms", 1.5 * longest * 1000 / LateTokens.MARGIN),)
    runs = {}
    for jitter in ((), cpu_fleet().itl_jitter):
        fleet = Fleet(FleetSpec("bidir-pd", replace(cpu_fleet(), itl_jitter=jitter), transfer=target))
        runs[bool(jitter)] = (fleet, fleet.run(trace))
    (plain_fleet, plain), (jit_fleet, jit) = runs[False], runs[True]
    assert [t.ttft_s for t in jit.turns] == [t.ttft_s for t in plain.turns]
    assert sum(w for _, w in jit.itl) == pytest.approx(sum(w for _, w in plain.itl))
    assert weighted_quantile(jit.itl, 0.99) > weighted_quantile(plain.itl, 0.99)
    top = max(ratio for ratio, _ in cpu_fleet().itl_jitter)
    assert max(g for g, _ in jit.itl) == pytest.approx(top * max(g for g, _ in plain.itl))

    def late(fleet):
        return sum(fleet.placement.streams.of(e.name).late.late for e in fleet.decode)

    assert late(plain_fleet) == 0
    mark = LateTokens.MARGIN * jit_fleet.transfer.itl_target_ms / 1000
    assert late(jit_fleet) > 0 and sum(w for g, w in jit.itl if g > mark) > 0


def test_the_jitter_of_a_measured_run_from_the_command_line(tmp_path, capsys):
    import json

    from bench.sim.__main__ import main

    gaps = [0.01, 0.01, 0.02, 0.01, 0.005, 0.01]
    results = {"modes": {"bidir-pd": {"records": {"4": [{"ok": True, "itl_s": gaps}] * 3}}}}
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(results))
    assert main(["--jitter", str(path), "--out", str(tmp_path / "out.json")]) == 0
    assert "(ratio, share)" in capsys.readouterr().out
    jitter = json.loads((tmp_path / "out.json").read_text())["jitter"]
    assert jitter[0][0] < 1.0 and jitter[-1][0] == 2.0  # the lowest quarter holds the halves


def test_a_jsonl_trace_runs_from_the_command_line(tmp_path, capsys):
    from bench.sim.__main__ import main
    from bench.traces import write_trace

    path = tmp_path / "trace.jsonl"
    write_trace(replace(SHAPE, sessions=3).generate(), path)
    assert main(["--trace", str(path), "--mode", "bidir", "--out", str(tmp_path / "out.json")]) == 0
    assert '"turns"' in capsys.readouterr().out
    assert (tmp_path / "out.json").exists()


def test_clients_send_the_benchmarks_way():
    """`run_clients`: every turn of every conversation, in order, one request a client at
    a time, no more conversations open than asked."""
    from bench.sim.published import benchmark_trace

    trace = benchmark_trace(first_prompt=3000)
    assert len(trace.sessions) == 24
    assert all(6 <= len(s.turns) <= 9 for s in trace.sessions)
    assert all(s.system_tokens + s.turns[0].tokens == 3000 for s in trace.sessions)
    fleet = Fleet(FleetSpec("bidir-pd", cpu_fleet()))
    run = fleet.run_clients(trace, clients=2, active=6)
    assert len(run.turns) == sum(len(s.turns) for s in trace.sessions)
    for s in trace.sessions:
        mine = [t for t in run.turns if t.session == s.session_id]
        assert [t.turn for t in mine] == list(range(1, len(s.turns) + 1))
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:], strict=False))
    spans = sorted((t.start_s, t.end_s) for t in run.turns)
    for start, _ in spans:
        assert sum(1 for a, b in spans if a <= start < b) <= 2
    with pytest.raises(ValueError):
        fleet.run_clients(trace, clients=3, active=2)


def test_a_legs_own_time_reaches_the_first_token():
    trace = Trace((TraceSession("a", 0.0, 100, (TraceTurn("user", 200, 5),)),))
    base = cpu_fleet()
    ttft = {}
    for leg_s in (0.0, 0.05):
        hw = replace(base, leg_s=leg_s, cores=0.0)
        ttft[leg_s] = {m: Fleet(FleetSpec(m, hw)).run(trace).turns[0].ttft_s for m in ("dp", "bidir-pd")}
    assert ttft[0.05]["dp"] == pytest.approx(ttft[0.0]["dp"] + 0.05)
    # Through prefill: the prefill leg's and the decode leg's.
    assert ttft[0.05]["bidir-pd"] == pytest.approx(ttft[0.0]["bidir-pd"] + 0.10)


def test_shared_cores_stretch_the_engines_and_the_host():
    """On half a core a lone turn's engine steps take twice as long, and its host-side
    costs twice (alone) to four times (beside the busy engine) as long."""
    trace = Trace((TraceSession("a", 0.0, 100, (TraceTurn("user", 200, 5),)),))
    base = replace(cpu_fleet(), host_cpu_per_turn_s=0.0)
    alone_fleet = Fleet(FleetSpec("dp", replace(base, cores=0.0)))
    alone = alone_fleet.run(trace).turns[0]
    shared_fleet = Fleet(FleetSpec("dp", replace(base, cores=0.5)))
    shared = shared_fleet.run(trace).turns[0]
    assert shared_fleet.decode[0].stats.busy_s == pytest.approx(2 * alone_fleet.decode[0].stats.busy_s)
    assert 2 * alone.ttft_s < shared.ttft_s < 4 * alone.ttft_s


def test_the_validation_report_counts_the_band_and_the_runs_range():
    from bench.sim.validate import _row, format_report

    inside = _row("dp", "TTFT p50 0-2k at 8 agents (s)", 0.100, 0.110, 0.2)
    outside = _row("dp", "TTFT p50 2-4k at 8 agents (s)", 0.100, 0.130, 0.2)
    outside["runs"] = (0.100, 0.120)  # within +-20% of the runs' range: 0.130 <= 0.144
    far = _row("oneway", "TTFT p50 0-2k at 8 agents (s)", 0.100, 0.200, 0.2)
    far["runs"] = (0.090, 0.150)  # 0.200 > 0.180
    gpu = dict.fromkeys(
        ("mfu", "oneway_s", "pull_s", "default_s", "oneway_later_s", "pull_later_s", "default_later_s"), 0.5
    )
    gpu.update(
        alone_oneway_s=0.7,
        alone_pull_s=0.2,
        ratio=2.0,
        published_ratio=1.69,
        within=False,
        read_latency_to_match_s=0.18,
        read_bandwidth_to_match=2.5e9,
        read_measured=[
            {
                "name": "reads at 4 GB/s",
                "mfu": 0.7,
                "oneway_s": 0.778,
                "pull_s": 0.4,
                "ratio": 1.95,
                "within": True,
            }
        ],
    )
    report = format_report([inside, outside, far], gpu)
    assert "1 of 3 figures within the band." in report
    assert "1 of the 2 TTFT figures measured in more than one run within +-20% of their range" in report
    assert "| 0.100-0.120 |" in report and "each GPU would read at 2.5 GB/s" in report
    assert "reads at 4 GB/s: MFU 0.700, one-way 778 ms, pull 400 ms: 1.95x (within the band)" in report
    # A modelled pull already slower than the published one: no read rate matches it.
    gpu.update(ratio=1.5, within=True, read_bandwidth_to_match=None)
    report = format_report([inside], gpu)
    assert "1.50x against 1.69x published (within the band)" in report
    assert "no read rate would" in report and "would read at" not in report


def test_a_measured_run_and_a_grid_of_that_day_can_be_the_validations_reference(tmp_path):
    """`--validate --run FILE --grid FILE`: the figures of a fleet study's results file
    (the placement rule read from its turns' reasons), and the CPU engine fitted on a
    grid file of `bench.prefill_cost --grid`."""
    import json

    from bench.sim.costs import fit_prefill, read_grid
    from bench.sim.reference import BUCKET_NAMES, read_reference

    def level(agents, tps, meets, placements):
        buckets = {name: {"turns": 3, "ttft_p50_s": 0.1 * (i + 1)} for i, name in enumerate(BUCKET_NAMES)}
        return {
            "agents": agents,
            "turns_per_s": tps,
            "ttft_p90_s": 0.5,
            "itl_p99_s": 0.03 if meets else 0.07,
            "meets_slo": meets,
            "buckets": buckets,
            "placements": placements,
        }

    modes = {
        "dp": {
            "goodput": {"agents": 4, "turns_per_s": 1.6},
            "levels": [level(4, 1.6, True, {}), level(8, 2.2, False, {})],
        },
        "bidir": {
            "goodput": {"agents": 8, "turns_per_s": 2.3},
            "levels": [level(4, 1.7, True, {"short": 40}), level(8, 2.3, True, {"itl": 30, "sooner": 3})],
        },
    }
    run = tmp_path / "fleet.json"
    run.write_text(json.dumps({"modes": modes}))
    steps = {"DecodeServer": {"mean_s": 0.012, "decode_s": 0.01, "prompt_s": 0.1, "prompt_share": 0.02}}
    modes["dp"]["levels"][0]["engine_steps"] = steps
    run.write_text(json.dumps({"modes": modes}))
    ref = read_reference(str(run))
    assert ref.steps == {("dp", 4): steps}
    from bench.sim.validate import format_steps

    sim = {"agents": 4, "engine_steps": {"DecodeServer": {"mean_s": 0.01, "decode_s": 0.008}}}
    table = format_steps([{"mode": "dp", "sim": sim, "measured_steps": steps}])
    assert "| dp | 4 | decode | 12.0 / 10.0 | 10.0 / 8.0 | 100.0 / - | 0.02 / - | - / - |" in table
    assert format_steps([{"mode": "dp", "sim": sim, "measured_steps": None}]) == ""
    assert ref.goodput == {"dp": (1.6, 4), "bidir": (2.3, 8)}
    assert ref.ttft_p50["bidir"] == pytest.approx((0.1, 0.2, 0.3, 0.4))
    assert ref.levels[("dp", 8)] == (2.2, 0.5, 0.07) and ref.placement == "priced"
    assert ref.sessions_per_agent == 1
    # dp deployed again in the run (`dp-again`) is not a mode of its own here; a run of
    # three sessions per agent is replayed with three.
    modes["dp-again"] = modes["dp"]
    run.write_text(json.dumps({"modes": modes, "sessions_per_agent": 3}))
    again = read_reference(str(run))
    assert set(again.goodput) == {"dp", "bidir"} and again.sessions_per_agent == 3
    modes["bidir"]["levels"][1]["placements"] = {"busy": 2, "idle": 40}  # the static rule's reasons
    run.write_text(json.dumps({"modes": modes}))
    assert read_reference(str(run)).placement == "static"

    # A grid 20% slower than the docs' everywhere fits an engine 20% slower.
    from bench.sim.params import CPU_DECODE_GRID, CPU_PREFILL_GRID

    points = [{"new": n, "cached": c, "median_s": s * 1.2} for n, c, s in CPU_PREFILL_GRID]
    decode = [{"batch": b, "history": c, "step_s": s * 1.2} for b, c, s in CPU_DECODE_GRID]
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"results": {"plain": {"points": points, "decode": decode}}}))
    grid = read_grid(str(path))
    assert len(grid.prefill) == len(CPU_PREFILL_GRID) and grid.decode[0] == (
        1,
        0,
        pytest.approx(0.00448 * 1.2),
    )
    slower, docs = cpu_fleet(grid).engine, cpu_fleet().engine
    assert slower.token_s == pytest.approx(fit_prefill(CPU_PREFILL_GRID)[1] * 1.2, rel=1e-3)
    assert slower.step_s > docs.step_s


def test_replays_move_only_the_arrivals_and_the_validation_reads_their_median():
    """`jittered` keeps the workload and moves each arrival by at most its spread, the same
    for the same seed; the validation's simulated figure is the replays' median, with
    their range beside it."""
    from bench.profiles import profile
    from bench.sim.reference import Reference
    from bench.sim.study import jittered, level_trace
    from bench.sim.validate import cpu_table

    shape = profile("fleet").trace
    assert shape is not None
    trace = level_trace(shape, 8)
    moved = jittered(trace, 3, spread_s=0.05)
    assert [s.turns for s in moved.sessions] == [s.turns for s in trace.sessions]
    shifts = [m.start_s - s.start_s for m, s in zip(moved.sessions, trace.sessions, strict=True)]
    assert all(abs(d) <= 0.05 + 1e-9 for d in shifts) and any(abs(d) > 0.001 for d in shifts)
    assert jittered(trace, 3, spread_s=0.05) == moved and jittered(trace, 4, spread_s=0.05) != moved

    ref = Reference("one mode", {"dp": (2.0, 8)}, {"dp": (0.1, 0.1, 0.1, 0.4)}, {("dp", 8): (2.0, 0.4, 0.04)})
    levels: list = []
    rows = cpu_table(shape, levels_out=levels, ref=ref, replays=3)
    assert len(rows) == 5 and all(r["replays"][0] <= r["simulated"] <= r["replays"][1] for r in rows)
    assert [lv["sim"]["agents"] for lv in levels] == [8] and levels[0]["sim"]["met"].endswith("/3")
    once = cpu_table(shape, ref=ref, replays=1)
    assert all(r["replays"][0] == r["simulated"] == r["replays"][1] for r in once if r["simulated"])


def test_a_turns_engine_time_is_its_engines_part_of_the_first_token():
    """`engine_s`: from reaching the engine that streams the answer to its first output
    (a lone dp turn: its prompt's compute, as the grid prices it); the rest of the TTFT is
    the host's (hops, ingress, store, the leg's own overhead)."""
    trace = Trace((TraceSession("a", 0.0, 100, (TraceTurn("user", 200, 5),)),))
    hw = replace(cpu_fleet(), cores=0.0)
    turn = Fleet(FleetSpec("dp", hw)).run(trace).turns[0]
    assert turn.engine_s == pytest.approx(hw.engine.step(0, 0, [(300, 0)]))  # one step of its 300 tokens
    assert 0 < turn.engine_s < turn.ttft_s
    assert turn.ttft_s - turn.engine_s >= hw.ingress_s + hw.hop_s + hw.leg_s


def test_the_step_waits_fitted_on_a_run_bring_the_simulated_steps_to_the_measured(tmp_path):
    """`bench.sim.stepwait.fit`: the wait per decode step, dp's engines apart from the P/D
    engines, is the measured decode-only step less the simulated one at no wait; with it
    the simulated steps come out at the measured."""
    import json

    from bench.sim import stepwait

    def write(decode_s):
        modes = {
            mode: {
                "goodput": {"agents": 4, "turns_per_s": 1.0},
                "levels": [
                    {
                        "agents": 4,
                        "turns_per_s": 1.0,
                        "ttft_p90_s": 0.5,
                        "itl_p99_s": 0.03,
                        "buckets": {},
                        "placements": {"later": 1} if mode != "dp" else {},
                        "engine_steps": {"DecodeServer": {"decode_s": decode_s[mode]}},
                    }
                ],
            }
            for mode in ("dp", "bidir-pd")
        }
        path = tmp_path / "steps.json"
        path.write_text(json.dumps({"modes": modes}))
        return str(path)

    hw = cpu_fleet()
    at_none = stepwait.fit(write({"dp": 1e-6, "bidir-pd": 1e-6}), SHAPE, hw, replays=1)
    assert (at_none.plain_s, at_none.nixl_s) == (0.0, 0.0)  # measured faster: no wait
    sim = {r["mode"]: r["sim_s"] for r in at_none.rows if r["agents"] == 4}
    waits = stepwait.fit(write({"dp": sim["dp"] + 0.002, "bidir-pd": sim["bidir-pd"] + 0.005}), SHAPE, hw, 1)
    assert waits.plain_s == pytest.approx(0.002) and waits.nixl_s == pytest.approx(0.005)
    # Applied, the simulated decode-only steps come out near the measured.
    for mode, wait in (("dp", 0.002), ("bidir-pd", 0.005)):
        fleet = Fleet(FleetSpec(mode, waits.apply(hw), decode=2 if mode == "dp" else 1))
        fleet.run(warmup_trace(SHAPE))
        run = fleet.run(level_trace(SHAPE, 4), concurrency=4)
        assert run.engine_steps["DecodeServer"]["decode_s"] == pytest.approx(sim[mode] + wait, rel=0.15)


def test_reads_as_measured_elsewhere_price_each_gpus_link_and_keep_the_published_one_way_mean():
    """`--project --reads measured-rate`: NIXL reads at the rate vLLM RFC #50913 measured
    (167 MB in 38.7 ms), no fixed cost, the MFU refitted to the published one-way mean."""
    from bench.sim.published import PUBLISHED_ONEWAY_S, READS, fit_mfu, gpu_mean_ttft, with_reads

    hw = with_reads("measured-rate", tp=8)
    assert hw.link.latency_s == 0.0
    assert hw.link.bytes_per_s == pytest.approx(8 * 167e6 / 0.0387)
    assert "measured-rate" in hw.name
    _, fixed_s, rate = READS["measured-rate"]
    mfu = fit_mfu(nixl_latency_s=fixed_s, efa_bytes_per_s_per_gpu=rate)
    oneway, _ = gpu_mean_ttft("oneway", mfu, nixl_latency_s=fixed_s, efa_bytes_per_s_per_gpu=rate)
    assert oneway == pytest.approx(PUBLISHED_ONEWAY_S, rel=0.01)
    # Slower reads than the transfer at EFA's line rate leave less of the published mean to compute.
    assert mfu > fit_mfu(nixl_latency_s=GPU_NIXL_LATENCY_S)


def test_the_engines_spans_are_summarised_alike_from_a_run_and_from_the_simulation(tmp_path):
    """`--validate --run FILE`: per history bucket at 8 agents, the medians of TTFT, of the
    prefill and decode engines' spans (`app.api.metrics.turn_hops`) and of the tokens
    computed, measured from the run's turns and simulated from `TurnResult`s."""
    import json

    from bench.sim.fleet import RunResult, TurnResult
    from bench.sim.reference import read_reference
    from bench.sim.study import hops
    from bench.sim.validate import _hop_rows, format_hops

    def timings(prefill_engine, decode_engine):
        t = {"store_s": 0.002, "session_s": 0.003, "decode_engine_s": decode_engine}
        if prefill_engine is not None:
            t |= {"prefill_s": 0.01 + prefill_engine, "prefill_engine_s": prefill_engine}
        return t | {"first_token_s": t.get("prefill_s", 0.003) + decode_engine + 0.01}

    records = [
        {
            "ok": True,
            "ttft_s": 0.30,
            "prompt_tokens": 1500,
            "cached_tokens": 1300,
            "timings": timings(0.2, 0.03),
        },
        {
            "ok": True,
            "ttft_s": 0.10,
            "prompt_tokens": 1600,
            "cached_tokens": 1500,
            "timings": timings(None, 0.06),
        },
        {"ok": False, "ttft_s": None, "prompt_tokens": 1700, "cached_tokens": 0, "timings": {}},
    ]
    level = {"agents": 8, "turns_per_s": 2.0, "ttft_p90_s": 0.5, "itl_p99_s": 0.03, "meets_slo": True}
    level["buckets"] = {n: {"ttft_p50_s": 0.2} for n in ("0-2k", "2-4k", "4-8k", "long_tool")}
    run = tmp_path / "fleet.json"
    run.write_text(
        json.dumps({"modes": {"bidir": {"goodput": None, "levels": [level], "records": {"8": records}}}})
    )
    measured = read_reference(str(run)).hops["bidir"]
    assert measured["0-2k"] == {"ttft": 0.10, "prefill_engine": 0.2, "decode_engine": 0.03, "computed": 100.0}
    assert measured["2-4k"]["ttft"] is None

    simulated = RunResult(
        turns=[
            TurnResult("s", 1, "user", 100, 1500, 150, 0.25, "prefill", 0.0, engine_s=0.02, prefill_s=0.1),
            TurnResult("s", 2, "user", 100, 1700, 90, 0.08, "local:short", 1.0, engine_s=0.05),
        ]
    )
    sim = hops(simulated)
    assert sim["0-2k"] == {"ttft": 0.08, "prefill_engine": 0.1, "decode_engine": 0.02, "computed": 90.0}
    rows = _hop_rows("bidir", measured, [sim, sim])
    assert [r["bucket"] for r in rows] == ["0-2k"]  # buckets without measured turns are left out
    assert "| bidir | 0-2k | 0.100 / 0.080 | 0.200 / 0.100 | 0.030 / 0.020 | 100 / 90 |" in format_hops(rows)
    assert format_hops([]) == ""


def test_a_reads_cost_is_the_models_a_measured_case_or_an_operators_own():
    """`--project --reads`: the model's own (transfer and vLLM RFC #50913's hand-off), a
    `READS` key, or MS:GBPS from a cluster's own counters."""
    from bench.sim.params import GPU_NIXL_HANDOFF_S, GPU_NIXL_READ_S
    from bench.sim.published import DEFAULT_READS, READS, read_cost

    what, fixed_s, rate = read_cost("20:12")
    assert (fixed_s, rate) == (pytest.approx(0.020), pytest.approx(12e9)) and "20 ms + 12 GB/s" in what
    assert read_cost("measured-handoff")[1:] == READS["measured-handoff"][1:]
    # The model's read: the transfer at EFA's line rate and the RFC's 110 ms hand-off, which
    # the GPU engines' link carries; "line-rate" is the transfer alone.
    assert GPU_NIXL_HANDOFF_S == pytest.approx(0.110)
    fixed_s, rate = read_cost(DEFAULT_READS)[1:]
    assert (fixed_s, rate) == (pytest.approx(GPU_NIXL_LATENCY_S + 0.110), EFA_BYTES_PER_S_PER_GPU)
    assert gpu_qwen3_32b(tp=2).link.latency_s == GPU_NIXL_READ_S
    assert read_cost("line-rate")[1:] == (GPU_NIXL_LATENCY_S, EFA_BYTES_PER_S_PER_GPU)
    for bad in ("fast", "20", "20:0", "-1:5", "a:b"):
        with pytest.raises(ValueError):
            read_cost(bad)
