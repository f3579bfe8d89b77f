"""`bench.sim.costs` and `bench.sim.engine`: the cost models, and an engine's step loop
conserving tokens and blocks."""

from __future__ import annotations

import math

import pytest
import simpy

from bench.sim.costs import EngineCost, Link, blocks, fit_token_s, gpu_cost
from bench.sim.engine import Engine, Job

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


def test_fit_recovers_the_per_token_cost():
    truth = EngineCost(0.005, 2e-4, 2e-4 * 1e-3, 0.0, 0.0, 4096)
    points = [(n, c, truth.step_s + truth.prefill_s(n, c)) for n, c in ((300, 1000), (1000, 0), (2000, 4000))]
    assert fit_token_s(points, truth.step_s, 1e-3) == pytest.approx(2e-4)


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
