"""One simulated vLLM engine: a step loop with continuous batching and chunked prefill,
on simpy's clock, priced by `bench.sim.costs.EngineCost`.

A request (`Job`) brings `new` prompt tokens to compute over `cached` tokens the engine
already holds, and wants `answer` tokens. Each step decodes one token for every running
sequence, then fills the rest of the step's token budget with waiting prefills in arrival
order (a prefill may span steps). The step that finishes a job's prompt samples its first
token (`Job.first` fires); the job then decodes its other `answer - 1` tokens, one a step,
and `Job.done` fires after its last. A job with `new == 0` (its KV arrived over NIXL)
joins the next step directly. A job with `answer == 0` (a prefill leg) is done at its
first token.

A job whose KV (or part of it) lives on another engine brings its read's time
(`Job.read_s`, NIXL priced by `costs.Link`), and the engine reads it as vLLM's scheduler
and KV connector do: the read is issued at the first step boundary after the job
arrives (the scheduler allocates its blocks; the worker starts the read as that step
runs), and is seen done at the first boundary after it completes (the worker polls the
transfers at the end of each step); the job is scheduled from there. On an idle engine
that is the read's time alone; on a busy one a read waits for the step in progress and
is seen only when the step it overlaps ends.

Bookkeeping the tests check: every prompt token a job brings is computed exactly once
(`computed_tokens`), every answer token decoded exactly once (`decoded_tokens`), and the
KV blocks of running sequences return to zero when the engine is idle (`blocks_in_use`).
Inter-token latency is kept as (step seconds, sequences that waited that long) pairs,
one per step, rather than one sample per token; `on_outputs`, when set, is told the same
for every step, a decode stretch's steps in one call (the ingress's view of its streams'
gaps, `bench.sim.policy`).

On a host whose engines share few cores with the serving processes (the CPU fleet
study: two one-thread engines, the ingress, Serve's proxy, the engines' front ends and
the client on 2 cores), `HostCpu` stretches each step by the share of a core its engine
gets: the busy engines and the host's own work (`cpu_per_turn_s` for every turn begun in
the last `window_s`) divided over `cores`, processor-shared. GPU engines do not share:
no `HostCpu`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from app.engines.wire import PROMPT_STEP_TOKENS
from bench.sim.costs import EngineCost, blocks


class HostCpu:
    """The cores a host's engines and serving processes share (processor sharing)."""

    def __init__(self, env: simpy.Environment, cores: float, cpu_per_turn_s: float, window_s: float = 5.0):
        if cores <= 0:
            raise ValueError("cores must be positive")
        self.env = env
        self.cores = cores
        self.cpu_per_turn_s = cpu_per_turn_s
        """CPU seconds of the serving processes per turn (its request, its prompt's
        tokenization, its stream's chunks through the engine's front end, the ingress, the
        proxy and the client)."""
        self.window_s = window_s
        self.engines: list[Engine] = []
        self._begun: deque[float] = deque()

    def turn_begun(self) -> None:
        self._begun.append(self.env.now)

    def host_cores(self) -> float:
        """The serving processes' demand now: CPU seconds per turn times the turns begun
        a second over the last `window_s`."""
        start = self.env.now - self.window_s
        while self._begun and self._begun[0] < start:
            self._begun.popleft()
        return self.cpu_per_turn_s * len(self._begun) / self.window_s

    def changed(self, source: Engine) -> None:
        """`source` went idle or busy: the other engines' decode stretches re-price their
        steps from the one in progress."""
        for e in self.engines:
            if e is not source and e.in_stretch and not e._wake.triggered:
                e._wake.succeed()

    def host_stretch(self) -> float:
        """How much longer the serving processes' own work takes than on a core of its own:
        as `stretch`, the host counted as at least one runnable task."""
        return self._shared(max(1.0, self.host_cores()))

    def stretch(self) -> float:
        """How much longer a step takes than on a core of its own: busy engines and the
        host's demand over the cores, at least 1."""
        return self._shared(self.host_cores())

    def _shared(self, host: float) -> float:
        busy = sum(1 for e in self.engines if not e.idle())
        return max(1.0, (busy + host) / self.cores)


@dataclass(eq=False)
class Job:
    new: int
    cached: int
    answer: int
    first: Any = None  # simpy.Event, set by `Engine.submit`
    done: Any = None
    left: int = 0
    """Prompt tokens still to compute."""
    first_at: float | None = None
    tag: Any = None
    read_s: float = 0.0
    """Time of the read of its KV from another engine, before it can be scheduled."""
    seq: int = 0
    """Its order of arrival at its engine (set by `submit`): ties between jobs that end in
    the same step break by it, so a run does not depend on where objects sit in memory."""
    ready_at: float | None = None
    """When its read completes (set when the engine issues it)."""
    submitted_at: float = 0.0
    """When it reached its engine (set by `submit`)."""

    @property
    def context(self) -> int:
        return self.cached + self.new


@dataclass
class _Running:
    job: Job
    joined_step: int
    start_ctx: int
    finish_step: int


@dataclass
class EngineStats:
    steps: int = 0
    busy_s: float = 0.0
    computed_tokens: int = 0
    decoded_tokens: int = 0
    itl: list[tuple[float, int]] = field(default_factory=list)
    """(step seconds, sequences that had a token before the step and got one in it)."""
    peak_blocks: int = 0
    loaded_steps: int = 0
    loaded_s: float = 0.0
    """The steps that began with requests running (sequences decoding, or a prompt
    part-computed: a prefill engine's too), as the app's replicas count busy steps
    (`PromptTokenCounts.busy_step`: a step that began on an idle engine is none)."""
    prompt_steps: int = 0
    prompt_s: float = 0.0
    """Of those, the steps in which a prompt of more than `PROMPT_STEP_TOKENS` computed
    tokens got its first token (`PromptTokenCounts.prompt_steps`)."""
    step_seqs: int = 0
    """The requests running at the end of each of those steps, summed (`busy_step_seqs`)."""


class Engine:
    """One engine. `submit` queues a job and returns it with its `first` and `done`
    events; `queued_tokens` is what the router weighs."""

    def __init__(
        self,
        env: simpy.Environment,
        cost: EngineCost,
        name: str,
        block_size: int,
        request_chunk: int = 0,
        macro_steps: bool = True,
        cpu: HostCpu | None = None,
        step_wait_s: float = 0.0,
    ):
        self.env = env
        self.cpu = cpu
        self.step_wait_s = step_wait_s
        """Added to every step, beyond its compute (`Hardware.step_wait_s`)."""
        if cpu is not None:
            cpu.engines.append(self)
        self.macro_steps = macro_steps
        """Run stretches of decode-only steps as one event (same times; ITL kept per
        stretch as its mean step, weighted by its tokens)."""
        self.request_chunk = request_chunk or cost.chunk_tokens
        """Prompt tokens of one request per step at most (vLLM's `long_prefill_token_threshold`)."""
        self.cost = cost
        self.name = name
        self.block_size = block_size
        self.stats = EngineStats()
        self._waiting: deque[Job] = deque()
        self._joining: list[Job] = []
        self._to_read: list[Job] = []
        """Arrived, their read not yet issued (it is, at the next step boundary)."""
        self._reading: list[Job] = []
        """Their read issued; scheduled at the first step boundary after it completes."""
        self._running: dict[int, _Running] = {}
        self._finish: list[tuple[int, int]] = []  # heap of (finish step, job seq)
        self._arrivals = itertools.count(1)
        self._ctx = 0
        self._blocks = 0
        self._step = 0
        self._wake: simpy.Event = env.event()
        self.in_stretch = False
        """In a run of decode-only steps priced as one event (`_decode_stretch`)."""
        self.queued_tokens = 0
        self.on_outputs: Callable[[Sequence[float], int], None] | None = None
        """Called with the seconds of each step done (one, or a decode stretch's) and the
        sequences that got an output that long after their previous one in each."""
        env.process(self._loop())

    # -- callers ---------------------------------------------------------------------------

    def _stretch(self) -> float:
        return 1.0 if self.cpu is None else self.cpu.stretch()

    def submit(self, job: Job) -> Job:
        if self.cpu is not None and self.idle():
            self.cpu.changed(self)
        job.first, job.done = self.env.event(), self.env.event()
        job.seq = next(self._arrivals)
        job.submitted_at = self.env.now
        job.left = max(0, job.new)
        self.queued_tokens += job.left
        if job.read_s > 0:
            self._to_read.append(job)
        else:
            self._schedulable(job)
        if not self._wake.triggered:
            self._wake.succeed()
        return job

    def _schedulable(self, job: Job) -> None:
        if job.left:
            self._waiting.append(job)
        else:
            self._joining.append(job)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def blocks_in_use(self) -> int:
        return self._blocks

    def idle(self) -> bool:
        return not (self._waiting or self._joining or self._running or self._to_read or self._reading)

    def _boundary(self) -> None:
        """A step boundary: reads seen done are scheduled, reads arrived are issued."""
        now = self.env.now
        done = [job for job in self._reading if job.ready_at is not None and job.ready_at <= now]
        for job in done:
            self._reading.remove(job)
            self._schedulable(job)
        for job in self._to_read:
            job.ready_at = now + job.read_s
            self._reading.append(job)
        self._to_read = []

    def _next_read_s(self) -> float | None:
        """Seconds until the earliest issued read completes (None: none is in flight)."""
        ready = [job.ready_at for job in self._reading if job.ready_at is not None]
        return max(0.0, min(ready) - self.env.now) if ready else None

    # -- the step loop ---------------------------------------------------------------------

    def _loop(self) -> Generator[Any, Any, None]:
        while True:
            if self.idle():
                if self.cpu is not None:
                    self.cpu.changed(self)
                self._wake = self.env.event()
                yield self._wake
                continue
            self._boundary()
            if not (self._waiting or self._joining or self._running):
                # Only reads in flight: the engine polls until one is done (or a job arrives).
                self._wake = self.env.event()
                wait = self._next_read_s()
                yield self._wake if wait is None else self.env.timeout(wait) | self._wake
                continue
            if self.macro_steps and not (self._waiting or self._joining):
                yield from self._decode_stretch()
                continue
            waited = len(self._running)
            loaded = self._in_flight() > 0
            for job in self._joining:
                self._join(job)
            joined, self._joining = self._joining, []
            budget = max(0, self.cost.chunk_tokens - len(self._running))
            chunks: list[tuple[Job, int]] = []
            for job in self._waiting:
                if budget <= 0:
                    break
                n = min(job.left, budget, self.request_chunk)
                chunks.append((job, n))
                budget -= n
            dt = (
                self.cost.step(
                    len(self._running), self._ctx, [(n, job.context - job.left) for job, n in chunks]
                )
                * self._stretch()
                + self.step_wait_s
            )
            yield self.env.timeout(dt)
            self._after_step(dt, waited, joined, chunks, loaded)

    def _decode_stretch(self) -> Generator[Any, Any, None]:
        """Steps that only decode, up to the next sequence's end, as one event: step `j`
        of the stretch takes `a + d * (ctx + batch * j)`. A job submitted meanwhile
        joins at the end of the step in progress, as it would step by step."""
        batch, ctx = len(self._running), self._ctx
        f = self._stretch()
        a = (self.cost.step_s + self.cost.decode_seq_s * batch) * f + self.step_wait_s
        d = self.cost.decode_ctx_s * f
        k = max(1, self._finish[0][0] - self._step)

        def elapsed(m: int) -> float:  # seconds of the stretch's first m steps
            return m * a + d * (m * ctx + batch * m * (m - 1) / 2)

        started = self.env.now
        read = self._next_read_s()
        if read is not None:
            # Up to the step in which the earliest read completes: its end sees it done.
            m = 1
            while m < k and elapsed(m) < read:
                m += 1
            k = m
        self._wake = self.env.event()
        self.in_stretch = True
        yield self.env.timeout(elapsed(k)) | self._wake
        self.in_stretch = False
        m = k
        if self._wake.triggered:
            # Interrupted: finish the step in progress, then hand back to the step loop.
            m = 0
            while m < k and elapsed(m + 1) <= self.env.now - started:
                m += 1
            if m < k:
                m += 1
                yield self.env.timeout(max(0.0, started + elapsed(m) - self.env.now))
        if self.on_outputs is not None:
            self.on_outputs([a + d * (ctx + batch * j) for j in range(m)], batch)
        self._steps_done(m, elapsed(m), batch)

    def _steps_done(self, m: int, seconds: float, batch: int) -> None:
        st = self.stats
        self._step += m
        st.steps += m
        st.busy_s += seconds
        st.loaded_steps += m
        st.loaded_s += seconds
        st.decoded_tokens += batch * m
        st.itl.append((seconds / m, batch * m))
        self._ctx += batch * m
        self._finished()
        st.step_seqs += batch * (m - 1) + len(self._running)

    def _join(self, job: Job) -> None:
        self._blocks += blocks(job.context + job.answer, self.block_size)
        self.stats.peak_blocks = max(self.stats.peak_blocks, self._blocks)
        key = job.seq
        finish = self._step + max(1, job.answer)
        self._running[key] = _Running(job, self._step, job.context, finish)
        heapq.heappush(self._finish, (finish, key))
        self._ctx += job.context

    def _after_step(
        self, dt: float, waited: int, joined: list[Job], chunks: list[tuple[Job, int]], loaded: bool
    ) -> None:
        """A step of `dt` seconds ended: `waited` sequences got an output after waiting on
        it, `joined` got their first, `chunks` computed; `loaded`: it began with requests
        running (sequences, or a prompt part-computed), as the app counts a busy step."""
        self._step += 1
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.decoded_tokens += len(self._running)
        if waited:
            st.itl.append((dt, waited))
            if self.on_outputs is not None:
                self.on_outputs((dt,), waited)
        self._ctx += len(self._running)
        now = self.env.now
        for job in joined:
            self._first(job, now)
        for job, n in chunks:
            job.left -= n
            self.queued_tokens -= n
            st.computed_tokens += n
            if job.left == 0:
                self._waiting.remove(job)
                self._first(job, now)
                if job.answer > 0:
                    self._join(job)
                    # Its prefill step sampled the first token: one fewer to decode.
                    run = self._running[job.seq]
                    run.finish_step = self._step + job.answer - 1
                    heapq.heappush(self._finish, (run.finish_step, job.seq))
                    st.decoded_tokens += 1
                else:
                    job.done.succeed()
        self._finished()
        if loaded:
            st.loaded_steps += 1
            st.loaded_s += dt
            st.step_seqs += self._in_flight()
            if any(job.left == 0 and job.new > PROMPT_STEP_TOKENS for job, _ in chunks):
                st.prompt_steps += 1
                st.prompt_s += dt

    def _in_flight(self) -> int:
        """The requests vLLM would count running now: sequences decoding, and prompts part-computed."""
        return len(self._running) + sum(1 for job in self._waiting if job.left < job.new)

    def _finished(self) -> None:
        while self._finish and self._finish[0][0] <= self._step:
            step, key = heapq.heappop(self._finish)
            ended = self._running.get(key)
            if ended is None or ended.finish_step != step:
                continue  # superseded entry
            del self._running[key]
            self._ctx -= ended.start_ctx + (step - ended.joined_step)
            self._blocks -= blocks(ended.job.context + ended.job.answer, self.block_size)
            ended.job.done.succeed()

    @staticmethod
    def _first(job: Job, now: float) -> None:
        job.first_at = now
        job.first.succeed()
