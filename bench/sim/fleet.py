"""The simulated fleet: an ingress (one replica), prefill and decode engine pools, the
handle store, and the agents of a trace, on one simpy clock.

A turn's life, per mode (each hop a Serve call, priced `hop_s`; each NIXL read by
`Link`, issued and seen done by the reading engine's step loop; each engine leg a
`bench.sim.engine.Job`):

* `dp`: engines that prefill and decode (`single`), session affinity; the engine's
  prefix cache (LRU over what its running sequences leave free) holds the history.
* `oneway`: prefill computes the whole prompt, decode reads all of it, then streams.
* `bidir`, `bidir-pd`, `bidir-nopin`: the store claims the session's handle (the app's
  `HandleStore`); the app's placement (`bench.sim.policy`) sends the turn to its decode
  replica alone, or through prefill, which pulls the history from decode, computes the
  rest, and decode reads back only what it lacks. The new turn's handle is stored, its
  blocks pinned within the app's budget, the old one settled and released. `bidir-pd`:
  every turn through prefill; `bidir-nopin`: no handles (prefill recomputes, decode
  relies on its prefix cache).

Agents follow their trace: a session's turn is sent its pause after the previous answer
ended. `run` can be called again on the same fleet (a warm-up, then a level), as the
benchmark drives one deployment.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from bench.fleet import step_figures
from bench.sim import policy
from bench.sim.costs import jittered
from bench.sim.engine import Engine, HostCpu, Job
from bench.sim.params import Hardware
from bench.traces import Trace, TraceSession
from connector.store import TurnOutcome

TurnProcess = Generator[Any, Any, None]
"""A simpy process (or part of one) of a turn."""

MODES = ("dp", "oneway", "bidir", "bidir-pd", "bidir-nopin", "bidir-host")
PD_MODES = MODES[1:]


@dataclass(frozen=True)
class FleetSpec:
    mode: str
    hw: Hardware
    prefill: int = 1
    decode: int = 1
    """Decode engines (dp: all its engines)."""
    placement: str = "priced"
    """The app's `transfer.placement` ("static": the rule before the priced one)."""
    transfer: tuple[tuple[str, Any], ...] = ()
    """The app's other `transfer.*` settings changed, as bench's `--transfer` changes them
    (bidir-pd still sends every turn through prefill)."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} not in {MODES}")
        if self.decode < 1 or (self.mode != "dp" and self.prefill < 1):
            raise ValueError("at least one engine of each role")


@dataclass
class TurnResult:
    session: str
    turn: int
    kind: str
    tokens: int
    """Tokens the turn adds (its tool result or user message)."""
    prompt_tokens: int
    computed_tokens: int
    ttft_s: float
    route: str
    """"local:<reason>", "prefill" (pulled), "prefill-recompute", "handoff" (a hosting prefill
    replica's leg over its own cache), or "single"."""
    start_s: float
    end_s: float = 0.0
    engine_s: float = 0.0
    """From reaching the engine that streams its answer to that engine's first output (a
    P/D turn's: decode's read and first step), as the app's `*_input_s` + `*_queue_s` +
    `*_compute_s`."""
    prefill_s: float | None = None
    """A P/D turn's prefill leg on its engine: from reaching it (the pull included) to its
    token, as the app's `prefill_engine_s`; None without a prefill leg."""


@dataclass
class RunResult:
    turns: list[TurnResult] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0
    itl: list[tuple[float, float]] = field(default_factory=list)
    """(gap seconds, outputs) as the client sees them: each engine step spread by the jitter."""
    computed_tokens: int = 0
    peak_pinned_blocks: int = 0
    store_calls: int = 0
    placements: dict[str, int] = field(default_factory=dict)
    """The placement's decisions by reason (`app.turn.placement.Reason`)."""
    aborted: bool = False
    """Stopped once too many turns missed the TTFT bound for its quantile to hold."""
    engine_steps: dict[str, dict | None] = field(default_factory=dict)
    """Per engine role, as the app names it: its steps while busy (`bench.fleet.step_figures`)."""

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


class PrefixCache:
    """Per engine: the sessions whose last turn's KV it still holds, least recent first,
    within the tokens its running sequences and pins leave free; a hit is in whole blocks
    (vLLM's prefix cache holds full blocks only: a history's last partial one is computed)."""

    def __init__(self, capacity_tokens: int, block_size: int = 1):
        self.capacity, self.block = capacity_tokens, block_size
        self._held: OrderedDict[str, int] = OrderedDict()
        self._total = 0

    def hit(self, session: str) -> int:
        return self._held.get(session, 0) // self.block * self.block

    def insert(self, session: str, tokens: int, busy_tokens: int) -> None:
        self._total += tokens - self._held.pop(session, 0)
        self._held[session] = tokens
        while self._held and self._total > max(0, self.capacity - busy_tokens):
            _, gone = self._held.popitem(last=False)
            self._total -= gone


class Fleet:
    def __init__(self, spec: FleetSpec):
        self.spec = spec
        hw = spec.hw
        self.env = simpy.Environment()
        clock: Callable[[], float] = lambda: self.env.now  # noqa: E731
        cost = hw.engine
        transfer: dict[str, Any] = {"placement": spec.placement, **dict(spec.transfer)}
        if spec.mode == "bidir-pd":
            transfer.update(decode_local_tokens=0, decode_local_busy_tokens=0)
        self.hosts = spec.mode == "bidir-host"  # prefill replicas host sessions (prefill_hosts)
        self.transfer = policy.transfer_config(**transfer)
        # The app's per-request prompt chunk on decode engines (`transfer.decode_chunk_tokens`
        # where the app has it; the static rule ran without it).
        chunked = spec.mode != "dp" and spec.placement == "priced"
        decode_chunk = getattr(self.transfer, "decode_chunk_tokens", 0) if chunked else 0
        self.placement = policy.PlacementState(clock, self.transfer, decode_chunk, hw.itl_jitter)
        self.cpu = HostCpu(self.env, hw.cores, hw.host_cpu_per_turn_s) if hw.cores else None
        prefill = 0 if spec.mode == "dp" else spec.prefill
        wait = hw.step_wait_s if spec.mode == "dp" else hw.step_wait_nixl_s  # P/D engines: the connector
        chunk = decode_chunk if self.hosts else 0  # a hosting prefill engine chunks as decode's do
        self.prefill = [
            Engine(self.env, cost, f"p{i}", hw.block_size, chunk, cpu=self.cpu, step_wait_s=wait)
            for i in range(prefill)
        ]
        self.decode = [
            Engine(self.env, cost, f"d{i}", hw.block_size, decode_chunk, cpu=self.cpu, step_wait_s=wait)
            for i in range(spec.decode)
        ]
        hosting = self.decode + (self.prefill if self.hosts else [])
        if spec.mode != "dp":
            for e in hosting:
                e.on_outputs = self._outputs_of(e.name)
        self.caches = {e.name: PrefixCache(hw.kv_blocks * hw.block_size, hw.block_size) for e in hosting}
        stored = spec.mode in ("bidir", "bidir-pd", "bidir-host")
        self.store = policy.make_store(clock, hw.block_size) if stored else None
        if self.store is not None:
            for e in hosting:
                self.store.set_engine_capacity(e.name, hw.kv_blocks)
        self._affinity: dict[str, Engine] = {}
        self._result = RunResult()
        self._bound: tuple[float, int] | None = None
        self._late = 0
        self._abort = self.env.event()

    # -- driving -------------------------------------------------------------------------

    def run(
        self, trace: Trace, ttft_bound: tuple[float, float] | None = None, concurrency: int = 0
    ) -> RunResult:
        """Every session of `trace`, from now; returns when the last answer ended.

        `ttft_bound` (seconds, quantile): stop as soon as more turns took longer than
        the bound than the quantile allows (the level has missed; `aborted`).
        `concurrency`: at most this many sessions at once, a later one starting (at its
        arrival or after) as one ends, as the benchmark's client runs them (0: no cap)."""
        bound = None
        if ttft_bound is not None:
            total = sum(len(s.turns) for s in trace.sessions)
            bound = (ttft_bound[0], total - math.ceil(ttft_bound[1] * total))
        slots = simpy.Resource(self.env, capacity=concurrency) if concurrency > 0 else None
        return self._measured(lambda: [self._session(s, self.env.now, slots) for s in trace.sessions], bound)

    def run_clients(self, trace: Trace, clients: int, active: int) -> RunResult:
        """`trace`'s sessions as vLLM's multi-turn benchmark sends them (`--num-clients`,
        `--max-active-conversations`): each of `clients` clients keeps its share of `active`
        conversations open, sends their turns round robin, one request at a time and no
        pause, and opens the next conversation when one ends. Start times and pauses are
        not used."""
        if clients < 1 or active < clients:
            raise ValueError("at least one client, and one active conversation per client")
        waiting = list(reversed(trace.sessions))
        shares = [active // clients + (1 if c < active % clients else 0) for c in range(clients)]

        def client(share: int) -> TurnProcess:
            open_: deque[tuple[TraceSession, int, int]] = deque()  # (session, next turn, history)
            while waiting or open_:
                while waiting and len(open_) < share:
                    s = waiting.pop()
                    open_.append((s, 0, s.system_tokens))
                s, i, history = open_.popleft()
                history = yield from self._turn(s, i, history)
                if i + 1 < len(s.turns):
                    open_.append((s, i + 1, history))

        return self._measured(lambda: [client(share) for share in shares])

    def _measured(
        self, processes: Callable[[], list[TurnProcess]], bound: tuple[float, int] | None = None
    ) -> RunResult:
        """Run `processes` (made now) to their end, or until `bound` (seconds, turns
        allowed past them) is overrun; what the engines did meanwhile."""
        self._result = result = RunResult(start_s=self.env.now)
        engines = self.prefill + self.decode
        itl_from = {e.name: len(e.stats.itl) for e in engines}
        roles = (("PrefillServer", self.prefill), ("DecodeServer", self.decode))
        steps_from = {role: _step_counters(group) for role, group in roles}
        computed_from = sum(e.stats.computed_tokens for e in engines)
        placed_from = self.placement.placed.copy()
        self._bound, self._late, self._abort = bound, 0, self.env.event()
        procs = [self.env.process(p) for p in processes()]
        self.env.run(until=simpy.AllOf(self.env, procs) | self._abort)
        result.aborted = self._abort.triggered
        result.end_s = self.env.now
        steps = [x for e in engines for x in e.stats.itl[itl_from[e.name] :]]
        result.itl = jittered(steps, self.spec.hw.itl_jitter)
        result.computed_tokens = sum(e.stats.computed_tokens for e in engines) - computed_from
        result.placements = dict(sorted((self.placement.placed - placed_from).items()))
        for role, group in roles:
            if group:
                now = _step_counters(group)
                result.engine_steps[role] = step_figures({k: now[k] - steps_from[role][k] for k in now})
        return result

    def _session(self, s: TraceSession, offset: float, slots: simpy.Resource | None = None) -> TurnProcess:
        yield self.env.timeout(max(0.0, offset + s.start_s - self.env.now))
        if slots is None:
            yield from self._turns(s)
            return
        with slots.request() as slot:
            yield slot
            yield from self._turns(s)

    def _turns(self, s: TraceSession) -> TurnProcess:
        history = s.system_tokens
        for i, turn in enumerate(s.turns):
            if i and turn.pause_s:
                yield self.env.timeout(turn.pause_s)
            history = yield from self._turn(s, i, history)

    def _turn(self, s: TraceSession, i: int, history: int) -> Generator[Any, Any, int]:
        """Turn `i` of `s` over `history` tokens; returns the history after its answer."""
        turn = s.turns[i]
        if self.cpu is not None:
            self.cpu.turn_begun()
        prompt = history + turn.tokens
        record = TurnResult(s.session_id, i + 1, turn.kind, turn.tokens, prompt, 0, 0.0, "", self.env.now)
        if self.spec.mode == "dp":
            yield from self._dp_turn(s.session_id, prompt, turn.answer_tokens, record)
        else:
            yield from self._pd_turn(s.session_id, i, prompt, turn.answer_tokens, record)
        record.end_s = self.env.now
        self._result.turns.append(record)
        return prompt + turn.answer_tokens

    # -- routing helpers -----------------------------------------------------------------

    @staticmethod
    def _least_loaded(engines: list[Engine]) -> Engine:
        return min(engines, key=lambda e: (e.queued_tokens, e.running))

    def _decode_of(self, session: str) -> Engine:
        engine = self._affinity.get(session)
        if engine is None:
            engine = self._affinity[session] = self._least_loaded(self.decode)
        return engine

    def _host_s(self, seconds: float) -> float:
        """Host-side work (hops, the store, the ingress, a leg's overhead) as long as the
        cores' sharing stretches it now, as it stretches the engines' steps."""
        return seconds if self.cpu is None else seconds * self.cpu.host_stretch()

    def _first(self, record: TurnResult, job: Job) -> None:
        """The turn's first token reached the ingress now (its engine's first output and
        `leg_s` ago); the client sees it `ingress_s` after its request's own share."""
        assert job.first_at is not None
        record.ttft_s = self.env.now - record.start_s + self._host_s(self.spec.hw.ingress_s)
        record.engine_s = job.first_at - job.submitted_at
        if self._bound is not None and record.ttft_s > self._bound[0]:
            self._late += 1
            if self._late > self._bound[1] and not self._abort.triggered:
                self._abort.succeed()

    # -- dp ------------------------------------------------------------------------------

    def _dp_turn(self, session: str, prompt: int, answer: int, record: TurnResult) -> TurnProcess:
        hw = self.spec.hw
        yield self.env.timeout(self._host_s(hw.store_call_s + hw.hop_s))
        engine = self._decode_of(session)
        cache = self.caches[engine.name]
        cached = min(cache.hit(session), prompt - 1)
        job = engine.submit(Job(prompt - cached, cached, answer))
        record.computed_tokens, record.route = prompt - cached, "single"
        yield job.first
        yield self.env.timeout(self._host_s(hw.leg_s))
        self._first(record, job)
        yield job.done
        cache.insert(session, prompt + answer, engine.blocks_in_use * hw.block_size)

    # -- P/D -----------------------------------------------------------------------------

    def _pd_turn(self, session: str, index: int, prompt: int, answer: int, record: TurnResult) -> TurnProcess:
        hw, mode, store = self.spec.hw, self.spec.mode, self.store
        claim, history = None, 0
        replica = self._affinity.get(session)
        if store is not None:
            yield self.env.timeout(self._host_s(hw.store_call_s))
            claim = store.begin_turn(session)
            self._result.store_calls += 1
            if claim.handle is not None:
                history = min(claim.handle.num_tokens // hw.block_size * hw.block_size, prompt - 1)
                if history < max(1, self.transfer.recompute_threshold_tokens):
                    history = 0
        elif mode == "bidir-nopin" and replica is not None:
            history = min(self.caches[replica.name].hit(session), prompt - 1)
        reason, host = None, None
        if self.hosts and (replica is None or replica in self.prefill):
            names = [e.name for e in self.prefill]
            hosted = replica.name if replica else self.placement.hosting(names, [e.name for e in self.decode])
            host = next((e for e in self.prefill if e.name == hosted), None)
            if host is not None:
                reason = self.placement.place_hosted(prompt - history, host.name, history)
                if reason or replica is not None:  # hosted, or handed to decode
                    self._affinity[session] = host if reason else self._least_loaded(self.decode)
                else:  # a new session the host cannot afford: priced on decode, as any
                    host = None
        if mode != "oneway" and host is None:
            new = prompt - history if history and replica is not None else prompt
            priced_on = replica.name if replica is not None else None
            if priced_on is None and self.spec.placement == "priced":
                # A new session is priced on the least-loaded replica (`Turns._placement_of`;
                # the static rule, as the CPU fleet study ran it, priced it on none).
                priced_on = self.placement.least_loaded([e.name for e in self.decode])
            reason = self.placement.place(new, priced_on, prompt - new)
            if reason is not None and replica is None:
                self._affinity[session] = next(e for e in self.decode if e.name == priced_on)
        if reason is not None:
            target = self._decode_of(session)
            job = yield from self._local_leg(target, prompt, prompt - history, answer, record, reason)
            outcome = TurnOutcome.UNUSED
        else:
            # Only a claimed handle can be pulled (bidir-nopin's history is decode's cache);
            # a hosting prefill replica's leg runs there over its own cache (the hand-off).
            pulled = yield from self._prefill_leg(prompt, history if claim is not None else 0, record, host)
            pulled = pulled and host is None
            outcome = TurnOutcome.PULLED if pulled else TurnOutcome.UNUSED
            target = self._decode_of(session)
            holds = history if (pulled and target is replica) else 0
            yield self.env.timeout(self._host_s(hw.hop_s))
            called = self.env.now
            read = hw.link.transfer_s(prompt - holds, hw.kv_bytes_per_token)
            job = target.submit(Job(0, prompt, answer, read_s=read))
            yield job.first
            yield self.env.timeout(self._host_s(hw.leg_s))
            self._first(record, job)
            self.placement.handoff.observe(self.env.now - called)
        yield from self._stream(target, job)
        if store is not None and claim is not None:
            conv = policy.conversation(session, index, target.name, prompt + answer, hw.block_size)
            store.end_turn(claim.lease_id, outcome, conv, engine_blocks=hw.kv_blocks)
            store.take_releases()
            self._result.store_calls += 1
            pinned = max(store.pinned_blocks(e.name) for e in self.decode + self.prefill)
            self._result.peak_pinned_blocks = max(self._result.peak_pinned_blocks, pinned)
        self.caches[target.name].insert(session, prompt + answer, target.blocks_in_use * hw.block_size)

    def _local_leg(
        self, target: Engine, prompt: int, new: int, answer: int, record: TurnResult, reason: str
    ) -> Generator[Any, Any, Job]:
        hw = self.spec.hw
        first = self.placement.local_leg(target.name, new, prompt - new)
        yield self.env.timeout(self._host_s(hw.hop_s))
        job = target.submit(Job(new, prompt - new, answer))
        record.computed_tokens, record.route = new, f"local:{reason}"
        yield job.first
        yield self.env.timeout(self._host_s(hw.leg_s))
        self._first(record, job)
        first()(new)
        return job

    def _prefill_leg(
        self, prompt: int, history: int, record: TurnResult, host: Engine | None = None
    ) -> Generator[Any, Any, bool]:
        """Hop to the least loaded prefill engine, pull `history` (if any), compute the rest;
        to `host` instead, which caches the history (nothing to read)."""
        hw = self.spec.hw
        history = min(self.caches[host.name].hit(record.session), prompt - 1) if host else history
        new = prompt - history
        end = self.placement.prefill_leg(new, history)
        engine = host or self._least_loaded(self.prefill)
        yield self.env.timeout(self._host_s(hw.hop_s))
        read = hw.link.transfer_s(history, hw.kv_bytes_per_token) if host is None else 0.0
        job = engine.submit(Job(new, history, 0, read_s=read))
        yield job.done
        record.prefill_s = self.env.now - job.submitted_at
        yield self.env.timeout(self._host_s(hw.leg_s))
        end(new)
        record.computed_tokens = new
        record.route = "handoff" if host else "prefill" if history else "prefill-recompute"
        return bool(history)

    def _stream(self, target: Engine, job: Job) -> TurnProcess:
        """The answer streams from `target` (counted in its streams, as `DecodeStreams.stream`
        counts them) until its last token; the gaps between its outputs come from the engine."""
        streams = self.placement.streams.of(target.name)
        streams.started(self.env.now)
        yield job.done
        streams.streams -= 1

    def _outputs_of(self, replica: str) -> Callable[[Sequence[float], int], None]:
        return lambda gaps, count: self.placement.outputs(replica, gaps, count)


def _step_counters(engines: list[Engine]) -> dict[str, float]:
    """`engines`' step counters under the names the app's replicas report them."""
    return {
        "engine_busy_steps": sum(e.stats.loaded_steps for e in engines),
        "engine_busy_step_s": sum(e.stats.loaded_s for e in engines),
        "engine_prompt_steps": sum(e.stats.prompt_steps for e in engines),
        "engine_prompt_step_s": sum(e.stats.prompt_s for e in engines),
        "engine_busy_step_seqs": sum(e.stats.step_seqs for e in engines),
    }
