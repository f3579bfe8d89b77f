"""`bench.sim.costs` and `bench.sim.engine`: the cost models, and an engine's step loop
conserving tokens and blocks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import simpy

from bench.sim.costs import (
    EngineCost,
    Link,
    blocks,
    fit_decode,
    fit_prefill,
    gpu_cost,
    jitter_of,
    jittered,
    least_squares,
)
from bench.sim.engine import Engine, HostCpu, Job

COST = EngineCost(
    step_s=0.01, token_s=1e-4, attn_s=1e-8, decode_seq_s=1e-3, decode_ctx_s=1e-6, chunk_tokens=512
)


def test_prefill_cost_grows_with_new_and_cached_tokens():
    assert COST.prefill_s(0, 1000) == 0.0
    assert COST.prefill_s(100) == pytest.approx(100 * (1e-4 + 1e-8 * 50))
    assert COST.prefill_s(100, 1000) > COST.prefill_s(100)
    # Attention over the chunk's own tokens: two halves cost what the whole does.
    assert COST.prefill_s(50) + COST.prefill_s(50, 50) == pytest.approx(COST.prefill_s(100))


def test_step_and_cold_prefill():
    assert COST.step(4, 2000, [(100, 0)]) == pytest.approx(0.01 + 4e-3 + 2e-3 + COST.prefill_s(100))
    # 1,200 tokens in chunks of 512: three steps.
    expected = sum(0.01 + COST.prefill_s(n, done) for n, done in ((512, 0), (512, 512), (176, 1024)))
    assert COST.cold_prefill_s(1200) == pytest.approx(expected)


def test_link_and_blocks():
    link = Link(latency_s=0.005, bytes_per_s=1e9)
    assert link.transfer_s(0, 4096) == 0.0
    assert link.transfer_s(1000, 4096) == pytest.approx(0.005 + 4096e3 / 1e9)
    assert blocks(0, 32) == 0 and blocks(1, 32) == 1 and blocks(64, 32) == 2 and blocks(65, 32) == 3


def test_a_prefill_chunk_pays_its_fixed_cost_once_per_step():
    chunked = replace(COST, chunk_s=0.002)
    assert chunked.step(0, 0, [(100, 0), (50, 0)]) == pytest.approx(
        COST.step(0, 0, [(100, 0), (50, 0)]) + 0.004
    )
    assert chunked.step(3, 900) == COST.step(3, 900)  # decode-only steps do not
    assert chunked.cold_prefill_s(1200) == pytest.approx(COST.cold_prefill_s(1200) + 3 * 0.002)


GRID = [(n, c) for n in (64, 256, 1024) for c in (0, 2048, 6144, 12288, 24576)]


def test_fit_prefill_recovers_the_fixed_dense_attention_and_context_costs():
    truth = EngineCost(0.006, 4e-5, 3e-9, 0.0, 0.0, 2048, chunk_s=0.004, chunk_ctx_s=1e-6)
    points = [(n, c, truth.step(0, 0, [(n, c)])) for n, c in GRID]
    assert fit_prefill(points) == pytest.approx((0.010, 4e-5, 3e-9, 1e-6))


def test_a_chunk_reads_its_context_once():
    reading = replace(COST, chunk_ctx_s=1e-6)
    assert reading.prefill_s(100, 5000) == pytest.approx(COST.prefill_s(100, 5000) + 5e-3)
    assert reading.prefill_s(0, 5000) == 0.0
    # Chunked, a cold prompt reads what the chunks before it computed.
    assert reading.cold_prefill_s(1200) == pytest.approx(COST.cold_prefill_s(1200) + 1e-6 * (512 + 1024))


def test_fit_prefill_keeps_short_legs_within_their_noise():
    # Relative least squares: 5% noise on the long legs leaves the short ones close.
    truth = EngineCost(0.008, 3e-5, 2e-9, 0.0, 0.0, 2048)
    points = [(n, c, (truth.step_s + truth.prefill_s(n, c)) * (1.05 if n == 1024 else 1.0)) for n, c in GRID]
    fitted = fit_prefill(points)
    model = EngineCost(0.0, fitted[1], fitted[2], 0.0, 0.0, 2048, chunk_s=fitted[0], chunk_ctx_s=fitted[3])
    for n, c, seconds in points:
        if n == 64:
            assert model.step(0, 0, [(n, c)]) == pytest.approx(seconds, rel=0.05)


def test_fits_never_return_a_negative_cost():
    # Noise that makes longer legs look cheaper: the per-token costs are held at 0.
    fixed, token_s, attn_s, ctx_s = fit_prefill([(64, 0, 0.020), (256, 0, 0.019), (1024, 0, 0.018)])
    assert min(fixed, token_s, attn_s, ctx_s) >= 0 and token_s == 0.0 and attn_s == 0.0
    assert 0.018 <= fixed <= 0.020
    with pytest.raises(ValueError):
        least_squares([(1.0, 2.0)], [0.0])


def test_fit_decode_recovers_the_step_sequence_and_context_costs():
    truth = EngineCost(0.006, 0.0, 0.0, 4e-4, 5e-8, 2048)
    points = [(b, c, truth.step(b, b * c)) for b in (1, 4) for c in (0, 2048, 12288, 24576)]
    step_s, seq_s, ctx_s = fit_decode(points)
    assert (step_s, seq_s, ctx_s) == pytest.approx((0.006, 4e-4, 5e-8))


def test_gpu_cost_from_published_figures():
    cost = gpu_cost(
        params=1e9,
        layers=10,
        attn_width=1000,
        weight_bytes=2e9,
        kv_bytes_per_token=1000,
        tp=2,
        peak_flops=1e15,
        mfu=0.5,
        hbm_bytes_per_s=1e12,
        hbm_efficiency=0.5,
        step_overhead_s=0.001,
        chunk_tokens=2048,
    )
    assert cost.token_s == pytest.approx(2e9 / 1e15)
    assert cost.attn_s == pytest.approx(4 * 10 * 1000 / 1e15)
    assert cost.step_s == pytest.approx(0.001 + 2e9 / 1e12)
    assert cost.decode_ctx_s == pytest.approx(1000 / 1e12)


def _run(
    jobs: list[tuple[float, Job]], cost: EngineCost = COST, macro: bool = True
) -> tuple[Engine, list[Job]]:
    env = simpy.Environment()
    engine = Engine(env, cost, "e", 32, macro_steps=macro)
    done: list[Job] = []

    def send(at: float, job: Job):
        yield env.timeout(at)
        engine.submit(job)
        yield job.done
        job.tag = env.now
        done.append(job)

    for at, job in jobs:
        env.process(send(at, job))
    env.run()
    return engine, done


def test_one_job_first_token_after_its_prefill_step():
    engine, done = _run([(0.0, Job(100, 0, 5))])
    job = done[0]
    assert job.first_at == pytest.approx(COST.step(0, 0, [(100, 0)]))
    assert engine.stats.steps == 5  # the prefill step samples token 1, four decode steps
    assert engine.stats.computed_tokens == 100 and engine.stats.decoded_tokens == 5


def test_long_prompt_is_chunked():
    engine, done = _run([(0.0, Job(1200, 0, 1))])
    assert engine.stats.steps == math.ceil(1200 / COST.chunk_tokens)
    assert done[0].first_at == pytest.approx(COST.cold_prefill_s(1200))


def _load() -> list[tuple[float, Job]]:
    jobs = [(0.01 * i, Job(50 + 97 * i % 900, 40 * i, 1 + 13 * i % 40)) for i in range(40)]
    jobs += [(0.02 * i, Job(0, 300 + i, 7)) for i in range(10)]  # KV arrived over NIXL
    jobs += [(0.03 * i, Job(200, 100, 0)) for i in range(5)]  # prefill legs
    # Reads from another engine: decode legs whose KV is read, prefill legs that pull history.
    jobs += [(0.015 * i + 0.001, Job(0, 400 + i, 6, read_s=0.004 + 0.003 * i)) for i in range(8)]
    jobs += [(0.025 * i + 0.002, Job(120, 600 + i, 0, read_s=0.01 + 0.002 * i)) for i in range(6)]
    return jobs


def test_tokens_and_blocks_are_conserved_under_load():
    jobs = _load()
    engine, done = _run(jobs)
    assert len(done) == len(jobs)
    assert engine.stats.computed_tokens == sum(j.new for _, j in jobs)
    assert engine.stats.decoded_tokens == sum(j.answer for _, j in jobs)
    assert engine.blocks_in_use == 0 and engine.idle() and engine.queued_tokens == 0
    assert all(j.first_at is not None for _, j in jobs)
    # Every decoded token after a first one is one inter-token gap.
    gaps = sum(w for _, w in engine.stats.itl)
    assert gaps == sum(max(0, j.answer - 1) for _, j in jobs)


def test_a_read_on_an_idle_engine_costs_its_time_alone():
    engine, done = _run([(0.0, Job(64, 1000, 0, read_s=0.05))])
    assert done[0].first_at == pytest.approx(0.05 + COST.step(0, 0, [(64, 1000)]))
    assert engine.stats.computed_tokens == 64 and engine.idle()


@pytest.mark.parametrize("macro", [True, False])
def test_a_read_is_issued_and_seen_done_at_step_boundaries(macro):
    """As vLLM's scheduler and connector: a job arriving mid-step has its read issued when
    that step ends, and is scheduled only after the step its read completes in."""
    first, second = COST.step(0, 0, [(512, 0)]), COST.step(0, 0, [(512, 512)])
    pulled = Job(10, 100, 0, read_s=0.001)
    _run([(0.0, Job(1024, 0, 0)), (first / 2, pulled)], macro=macro)
    assert pulled.first_at == pytest.approx(first + second + COST.step(0, 0, [(10, 100)]))
    # While the engine decodes, the read is seen at the end of the step it completes in.
    stream, read = Job(10, 0, 50), Job(0, 300, 3, read_s=0.025)
    _run([(0.0, stream), (0.001, read)], macro=macro)
    prefill = COST.step(0, 0, [(10, 0)])
    t, steps = prefill, 0
    while t < prefill + 0.025:
        t += COST.step(1, 10 + steps, [])  # the stream's decode steps, its context growing
        steps += 1
    # The read job joins the next step and gets its first token at its end.
    assert read.first_at == pytest.approx(t + COST.step(2, 10 + steps + 300, []), rel=1e-9)


def test_jobs_ending_in_one_step_end_in_their_order_of_arrival():
    """Ties break by arrival, not by where the jobs sit in memory: a run is the same in
    every process."""
    env = simpy.Environment()
    engine = Engine(env, COST, "e", 32)
    arrived = sorted((Job(50, 0, 4) for _ in range(4)), key=id, reverse=True)  # against their ids
    ended: list[Job] = []
    for job in arrived:
        engine.submit(job)
        job.done.callbacks.append(lambda _, job=job: ended.append(job))
    env.run()
    assert ended == arrived


def test_decode_stretches_keep_every_time():
    """Decode-only steps run as one event give the same first and last token times as
    step by step, arrivals mid-stretch included."""
    jobs, reference = _load(), _load()
    macro = _run(jobs, macro=True)[0]
    stepwise = _run(reference, macro=False)[0]
    for (_, a), (_, b) in zip(jobs, reference, strict=True):
        assert a.first_at == pytest.approx(b.first_at, abs=1e-9)
        assert a.tag == pytest.approx(b.tag, abs=1e-9)
    assert macro.stats.steps == stepwise.stats.steps
    assert macro.stats.busy_s == pytest.approx(stepwise.stats.busy_s)
    assert sum(w for _, w in macro.stats.itl) == sum(w for _, w in stepwise.stats.itl)


@pytest.mark.parametrize("macro", [True, False])
def test_every_stream_output_gap_is_reported_step_by_step(macro):
    """`on_outputs` hears of every gap the ITL samples hold, one call per step, in
    stretches too (where the samples keep only the stretch's mean)."""
    jobs = _load()
    env = simpy.Environment()
    engine = Engine(env, COST, "e", 32, macro_steps=macro)
    heard: list[tuple[float, int]] = []
    engine.on_outputs = lambda gaps, count: heard.extend((gap, count) for gap in gaps)
    for at, job in jobs:
        env.process(_send(env, engine, at, job))
    env.run()
    assert sum(c for _, c in heard) == sum(w for _, w in engine.stats.itl)
    assert sum(g * c for g, c in heard) == pytest.approx(sum(g * w for g, w in engine.stats.itl))
    assert len(heard) == sum(1 for g, _ in heard if g > 0) <= engine.stats.steps


def _send(env: simpy.Environment, engine: Engine, at: float, job: Job):
    yield env.timeout(at)
    engine.submit(job)
    yield job.done


def _shared(cores: float, macro: bool) -> tuple[list[Engine], list[Job]]:
    """Two engines on `cores` cores: a stream on one, prefills arriving on the other."""
    env = simpy.Environment()
    cpu = HostCpu(env, cores, cpu_per_turn_s=0.0)
    engines = [Engine(env, COST, f"e{i}", 32, macro_steps=macro, cpu=cpu) for i in range(2)]
    jobs = [Job(10, 0, 60)] + [Job(300, 0, 1) for _ in range(4)]
    env.process(_send(env, engines[0], 0.0, jobs[0]))
    for i, job in enumerate(jobs[1:]):
        env.process(_send(env, engines[1], 0.05 + 0.2 * i, job))
    env.run()
    return engines, jobs


def test_engines_sharing_cores_stretch_each_others_steps():
    alone, _ = _shared(cores=2.0, macro=False)
    shared, _ = _shared(cores=1.0, macro=False)
    # Two busy engines on one core: each step takes up to twice as long; never less.
    for a, b in zip(alone, shared, strict=True):
        assert a.stats.steps == b.stats.steps
        assert a.stats.busy_s < b.stats.busy_s <= 2 * a.stats.busy_s + 1e-9
    # The stream's steps while the prefills ran took twice as long as its others.
    gaps = sorted({round(g, 9) for g, _ in shared[0].stats.itl})
    assert any(g2 == pytest.approx(2 * g1, rel=0.05) for g1 in gaps for g2 in gaps)


def test_a_stretch_is_repriced_when_the_other_engine_changes():
    """Decode stretches on shared cores give the step-by-step times."""
    macro_engines, macro_jobs = _shared(cores=1.5, macro=True)
    step_engines, step_jobs = _shared(cores=1.5, macro=False)
    for a, b in zip(macro_jobs, step_jobs, strict=True):
        assert a.first_at == pytest.approx(b.first_at, abs=1e-9)
        assert a.tag == pytest.approx(b.tag, abs=1e-9)
    for a, b in zip(macro_engines, step_engines, strict=True):
        assert a.stats.busy_s == pytest.approx(b.stats.busy_s)


def test_host_demand_follows_the_turns_begun():
    env = simpy.Environment()
    cpu = HostCpu(env, 2.0, cpu_per_turn_s=0.2, window_s=5.0)
    for _ in range(10):
        cpu.turn_begun()
    assert cpu.host_cores() == pytest.approx(0.4)  # 10 turns in 5 s, 0.2 CPU-s each
    assert cpu.stretch() == 1.0  # no engine busy: 0.4 of 2 cores
    assert HostCpu(env, 0.5, 0.0).host_stretch() == 2.0  # the host's own work, alone on half a core
    env.run(until=6.0)
    assert cpu.host_cores() == 0.0
    with pytest.raises(ValueError):
        HostCpu(env, 0.0, 0.1)


def test_jitter_is_each_gap_over_its_streams_median_binned_by_quantile():
    # Two streams at different paces, each with the same spread: one gap in five twice its
    # stream's median, one in five half of it.
    slow = [0.02, 0.02, 0.02, 0.04, 0.01] * 20
    fast = [0.005, 0.005, 0.005, 0.01, 0.0025] * 20
    jitter = jitter_of([slow, fast, [0.5, 0.5]])  # the third is too short to count
    assert sum(share for _, share in jitter) == pytest.approx(1.0)
    ratios = [ratio for ratio, _ in jitter]
    assert ratios == sorted(ratios)
    # The lowest quarter: the fifth at half the median and a twentieth at it.
    assert ratios[0] == 0.6 and ratios[-1] == 2.0
    assert sum(r * s for r, s in jitter) == pytest.approx(0.2 * 0.5 + 0.6 * 1 + 0.2 * 2, abs=0.01)
    assert jitter_of([]) == ()


def test_jittered_samples_keep_their_weight_and_spread_the_gap():
    jitter = ((0.5, 0.5), (2.0, 0.5))
    samples = [(0.01, 4), (0.03, 2)]
    spread = jittered(samples, jitter)
    assert sum(w for _, w in spread) == pytest.approx(6)
    assert sorted(spread) == [(0.005, 2.0), (0.015, 1.0), (0.02, 2.0), (0.06, 1.0)]
    assert jittered(samples, ()) == samples


def test_the_decode_fit_takes_own_history_batches_at_the_grids_level():
    from bench.sim.params import CPU_DECODE_GRID, CPU_DECODE_OWN_GRID, decode_points

    points = decode_points()
    grid_single = {c: s for n, c, s in CPU_DECODE_GRID if n == 1}
    own = {(n, c): s for n, c, s in CPU_DECODE_OWN_GRID}
    added = [p for p in points if p not in CPU_DECODE_GRID]
    assert {(n, c) for n, c, _ in added} == {k for k in own if k[0] > 1}
    for n, c, s in added:
        # Each batch keeps its ratio to a single sequence over the same history.
        assert s / grid_single[c] == pytest.approx(own[(n, c)] / own[(1, c)])
    step_s, seq_s, ctx_s = fit_decode(points)
    assert step_s > 0 and seq_s > 0 and ctx_s > 0


def test_a_prompt_joining_streams_waits_for_the_step_in_progress_then_takes_one_step_with_them():
    """`bench.prefill_joining.simulated`: on an idle engine a prompt's first output is
    its one step; beside streams it is at most the step in progress plus one step that
    also decodes them."""
    from bench.prefill_joining import simulated
    from bench.sim.params import cpu_fleet

    cost = cpu_fleet().engine
    alone = cost.step(0, 0, [(256, 2048)])
    assert simulated(0, 2048, 256) == pytest.approx(alone)
    decode = cost.step(4, 4 * 2048)
    with_streams = simulated(4, 2048, 256)
    assert alone < with_streams <= decode + cost.step(4, 4 * 2048, [(256, 2048)]) + 1e-9


@pytest.mark.parametrize("macro", [True, False])
def test_the_engine_counts_its_busy_steps_as_the_apps_replicas_do(macro):
    """`EngineStats.loaded_steps` and its siblings, as `PromptTokenCounts.busy_step`: a step
    that began on an idle engine (the first prompt's) is none; a prompt that joins a
    streaming engine is a prompt step; every decode step of a stream is a busy step."""
    first, joining = Job(200, 0, 10), Job(300, 0, 5)
    engine, _ = _run([(0.0, first), (0.001, joining)], macro=macro)
    st = engine.stats
    # 10 steps: the first prompt's (not counted), then the first stream's 9 decode steps,
    # the first of which also computes the joining prompt.
    assert (st.steps, st.loaded_steps, st.prompt_steps) == (10, 9, 1)
    assert st.prompt_s == pytest.approx(COST.step(1, 200, [(300, 0)]))
    assert st.loaded_s == pytest.approx(st.busy_s - COST.step(0, 0, [(200, 0)]))
    # Sequences running at the end of each counted step: both streams for 4 steps, the
    # first alone for 4, none after the last.
    assert st.step_seqs == 2 * 4 + 1 * 4 + 0


def test_a_prefill_engine_counts_the_steps_of_a_prompt_in_chunks_as_the_app_does():
    """A prefill engine's jobs never decode (no answer): a step counts when a prompt was
    part-computed at its start, as vLLM counts such a request running. 1,200 tokens in
    chunks of 512: 3 steps, the first on an idle engine; the last gives the first token."""
    engine, _ = _run([(0.0, Job(1200, 0, 0))])
    st = engine.stats
    assert (st.steps, st.loaded_steps, st.prompt_steps) == (3, 2, 1)
    assert st.prompt_s == pytest.approx(COST.step(0, 0, [(176, 1024)]))
    # Part-computed at the end of the second step, none at the end of the last.
    assert st.step_seqs == 1 + 0
