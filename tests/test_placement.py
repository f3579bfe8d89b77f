"""The placement policy (`app.turn.placement`) on constructed loads, the decode engines' chunked
prefill that it prices (`app.engines.setup.decode_chunking`), and the stream counts that
feed it (`app.turn.pacing.DecodeStreams`). No clock is read by the decisions: loads are numbers."""

from __future__ import annotations

import pickle
import time

import pytest

from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest, Sampling
from app.turn.events import TurnCount
from app.turn.pacing import DecodeStreams, Ewma, LateTokens, LegCost, LegPace, LineFit
from app.turn.placement import DecodeLoad, Limits, PrefillLoad, Reason, place, place_static
from connector.handle import KVHandle, Location, local_decode_params

MS = 0.001
LIMITS = Limits(short_tokens=512, max_tokens=2048, itl_target_s=50 * MS, chunk_tokens=256)
PREFILL = PrefillLoad(seconds_per_token=0.1 * MS, tokens_in_flight=0, handoff_s=30 * MS)
"""An idle prefill pool computing 10k tokens/s, with a 30 ms hand-off to decode."""


def decode(
    pace: float | None = 0.1 * MS,
    ahead: int = 0,
    streams: int = 0,
    step_ms: float | None = None,
    fixed_ms: float = 0.0,
    late_budget: int = 0,
):
    step = None if step_ms is None else step_ms * MS
    return DecodeLoad(pace, ahead, streams, step, fixed_ms * MS, late_budget)


# -- the priced rule --------------------------------------------------------------------------


def test_a_short_turn_on_an_idle_replica_stays_on_decode():
    p = place(100, PREFILL, decode(), LIMITS)
    assert p.local and p.reason is Reason.SHORT


def test_a_short_turn_goes_to_prefill_when_it_would_stall_the_streams_past_target():
    # 20 streams stepping at 45 ms: 300 more tokens of prompt at 0.1 ms fill the step past 50 ms.
    busy = decode(streams=20, step_ms=45)
    p = place(300, PREFILL, busy, LIMITS)
    assert not p.local and p.reason is Reason.ITL
    assert p.stream_step_s == pytest.approx((45 + 0.1 * 256) * MS)  # one chunk of the 300 a step
    # A turn small enough to fit the step's headroom still goes there.
    q = place(40, PREFILL, busy, LIMITS)
    assert q.local and q.reason is Reason.SHORT and q.stream_step_s <= LIMITS.itl_target_s


def test_chunking_bounds_what_a_long_turn_adds_to_each_step():
    streams = decode(streams=8, step_ms=20)
    chunked = place(2000, PREFILL, streams, LIMITS)
    assert chunked.stream_step_s == pytest.approx((20 + 0.1 * 256) * MS)
    whole = place(2000, PREFILL, streams, Limits(512, 2048, 50 * MS, chunk_tokens=0))
    assert not whole.local and whole.reason is Reason.ITL
    assert whole.stream_step_s == pytest.approx((20 + 0.1 * 2000) * MS)


def test_decode_local_turns_in_flight_count_in_the_step():
    # Alone, 100 tokens add 10 ms to a 30 ms step; behind 200 in flight a full chunk adds 25.6 ms.
    alone = place(100, PREFILL, decode(streams=4, step_ms=30), LIMITS)
    assert alone.local and alone.stream_step_s == pytest.approx(40 * MS)
    behind = place(100, PREFILL, decode(ahead=200, streams=4, step_ms=30), LIMITS)
    assert not behind.local and behind.reason is Reason.ITL
    assert behind.stream_step_s == pytest.approx(55.6 * MS)


def test_a_longer_turn_goes_to_decode_when_it_answers_sooner_there():
    # Idle replica, measured: the same compute without the hand-off.
    p = place(1500, PREFILL, decode(), LIMITS)
    assert p.local and p.reason is Reason.SOONER
    assert p.decode_s == pytest.approx(0.15) and p.prefill_s == pytest.approx(0.15 + 0.03)


def test_a_longer_turn_stays_on_prefill_when_decode_is_slower_or_queued():
    slow = place(1500, PREFILL, decode(pace=0.2 * MS), LIMITS)
    assert not slow.local and slow.reason is Reason.LATER
    queued = place(1500, PREFILL, decode(ahead=1000), LIMITS)
    assert not queued.local and queued.reason is Reason.LATER


def test_the_streams_steps_count_against_decode_for_each_chunk():
    # 1,500 tokens in 6 chunks, each a step of 8 ms of streams: +48 ms, more than the hand-off.
    p = place(1500, PREFILL, decode(streams=2, step_ms=8), LIMITS)
    assert not p.local and p.reason is Reason.LATER
    assert p.decode_s == pytest.approx(0.15 + 6 * 0.008)
    # With prefill queued, the same turn is sooner on decode.
    queued = PrefillLoad(0.1 * MS, tokens_in_flight=3000, handoff_s=30 * MS)
    assert place(1500, queued, decode(streams=2, step_ms=8), LIMITS).reason is Reason.SOONER


def test_an_unmeasured_replica_saves_only_prefills_queue():
    unmeasured = decode(pace=None)
    # Idle prefill: the hand-off alone is not taken as a saving.
    assert place(1500, PREFILL, unmeasured, LIMITS).reason is Reason.LATER
    # Prefill has 2,000 tokens ahead: decode, at prefill's pace, is sooner.
    queued = PrefillLoad(0.1 * MS, tokens_in_flight=2000, handoff_s=30 * MS)
    p = place(1500, queued, unmeasured, LIMITS)
    assert p.local and p.reason is Reason.SOONER


def test_nothing_measured_keeps_the_short_rule_and_sends_the_rest_to_prefill():
    cold = PrefillLoad(None)
    assert place(300, cold, decode(pace=None, streams=3), LIMITS).reason is Reason.SHORT
    assert place(1000, cold, decode(pace=None), LIMITS).reason is Reason.LATER


def test_limits_bound_what_decode_is_ever_given():
    assert place(3000, PREFILL, decode(), LIMITS).reason is Reason.TOO_LONG
    off = Limits(0, 0, 50 * MS, 256)
    assert place(1, PREFILL, decode(), off).reason is Reason.TOO_LONG
    short_only = Limits(512, 0, 50 * MS, 256)
    assert place(500, PREFILL, decode(), short_only).reason is Reason.SHORT
    assert place(600, PREFILL, decode(), short_only).reason is Reason.TOO_LONG


def test_a_session_without_a_replica_gets_only_the_short_rule():
    assert place(100, PREFILL, None, LIMITS).reason is Reason.SHORT
    assert place(1000, PREFILL, None, LIMITS).reason is Reason.NO_REPLICA


def test_an_overloaded_replica_takes_nothing():
    over = decode(streams=30, step_ms=60)
    p = place(1, PREFILL, over, LIMITS)
    assert not p.local and p.reason is Reason.ITL


def test_a_turn_that_stretches_the_steps_spends_the_streams_late_budget():
    # 4 streams at 30 ms a step; 1,000 tokens in 4 chunks of 25.6 ms: each chunk's step is
    # past 50 ms, so each stream gets 4 late outputs, 16 in all. Prefill is queued.
    queued = PrefillLoad(0.1 * MS, tokens_in_flight=3000, handoff_s=30 * MS)
    assert place(1000, queued, decode(streams=4, step_ms=30, late_budget=15), LIMITS).reason is Reason.ITL
    p = place(1000, queued, decode(streams=4, step_ms=30, late_budget=16), LIMITS)
    assert p.local and p.reason is Reason.SOONER and p.stream_step_s > LIMITS.itl_target_s
    # A short one that stretches: one chunk, one late output per stream.
    assert place(250, PREFILL, decode(streams=4, step_ms=30, late_budget=4), LIMITS).reason is Reason.SHORT
    assert place(250, PREFILL, decode(streams=4, step_ms=30, late_budget=3), LIMITS).reason is Reason.ITL
    # No streams there: nothing to stretch, whatever the budget.
    assert place(1000, PREFILL, decode(late_budget=-5), LIMITS).local


def test_streams_that_will_start_while_a_long_turn_computes_are_priced():
    """A replica with no stream now, where 4 streams a second lately started beside others:
    a 1,400-token turn computes 6 chunks of 61 ms (10 ms a step, 0.2 ms a token), 0.37 s in
    which ~1.5 streams start, each waiting on half the chunks on average: 4 late outputs."""
    queued = PrefillLoad(0.1 * MS, tokens_in_flight=5000, handoff_s=30 * MS)  # prefill: ~0.67 s

    def idle(budget: int, joined_per_s: float = 4.0) -> DecodeLoad:
        return DecodeLoad(0.2 * MS, 0, 0, 10 * MS, 0.0, budget, 0.0, joined_per_s)

    p = place(1400, queued, idle(budget=4), LIMITS)
    assert p.local and p.reason is Reason.SOONER and p.late_outputs == 4
    assert p.stream_step_s == pytest.approx((10 + 0.2 * 256) * MS)
    assert place(1400, queued, idle(budget=3), LIMITS).reason is Reason.ITL
    # No start beside others lately, or starts rare enough: nothing to stall, whatever the budget.
    assert place(1400, queued, idle(budget=-5, joined_per_s=0.0), LIMITS).local
    assert place(1400, queued, idle(budget=0, joined_per_s=1 / 60), LIMITS).local
    # A short turn is one step: a stream that starts within it waits once at most.
    assert place(250, PREFILL, idle(budget=0), LIMITS).reason is Reason.SHORT


def test_only_starts_beside_running_streams_count_and_they_age_out():
    """One client's turns one after another start on an idle replica each time: none counts.
    Starts beside a running stream do, over the last `JOINED_WINDOW_S` only."""
    from app.turn.pacing import JOINED_WINDOW_S, ReplicaStreams

    streams = ReplicaStreams()
    for t in range(5):  # sequential: each stream ends before the next starts
        streams.started(float(t))
        streams.streams -= 1
    assert streams.joined_per_s(5.0) == 0.0
    streams.started(10.0)
    streams.started(10.5)  # beside the first
    streams.started(11.0)  # beside both
    assert streams.streams == 3
    assert streams.joined_per_s(11.0) == pytest.approx(2 / JOINED_WINDOW_S)
    assert streams.joined_per_s(10.5 + JOINED_WINDOW_S + 0.1) == pytest.approx(1 / JOINED_WINDOW_S)
    assert streams.joined_per_s(11.0 + JOINED_WINDOW_S + 0.1) == 0.0
    # Never read (a replica no turn is placed on): its starts are still forgotten.
    for t in range(1000):
        streams.started(100.0 + t)
    assert len(streams._joined) <= JOINED_WINDOW_S + 1


def test_a_turn_placed_on_decode_reserves_the_late_outputs_it_will_cause_until_its_first_token():
    from app.turn.pacing import LocalLeg

    late = LateTokens(target_s=50 * MS, fraction=0.01, window=2000)
    for _ in range(1000):
        late.observe(10 * MS)
    assert late.budget == 10
    queued = PrefillLoad(0.1 * MS, tokens_in_flight=3000, handoff_s=30 * MS)
    p = place(1000, queued, decode(streams=2, step_ms=30, late_budget=late.budget), LIMITS)
    assert p.local and p.late_outputs == 2 * 4  # 2 streams, 4 chunks each past the target
    pace = LegPace()
    leg = LocalLeg(pace, 1000, late, p.late_outputs)
    assert late.reserved == 8 and late.budget == 2
    # A second such turn now would overspend: it goes through prefill.
    q = place(1000, queued, decode(streams=2, step_ms=30, late_budget=late.budget), LIMITS)
    assert not q.local and q.reason is Reason.ITL
    leg.first_token()  # its chunks are computed: what they stretched has been counted
    assert late.reserved == 0 and pace.tokens_in_flight == 0
    leg.end(1000)
    assert late.reserved == 0
    failed = LocalLeg(pace, 500, late, 3)
    failed.end(None)  # a turn that failed before its first token releases its reservation
    assert late.reserved == 0 and pace.tokens_in_flight == 0


def test_streams_already_late_beyond_their_share_take_no_turn_at_all():
    # A 10-token turn would keep the step at 21 ms, within target, but the streams there
    # came late more often than they may: every turn goes through prefill until they recover.
    p = place(10, PREFILL, decode(streams=4, step_ms=20, late_budget=-1), LIMITS)
    assert not p.local and p.reason is Reason.ITL
    assert place(10, PREFILL, decode(streams=4, step_ms=20, late_budget=0), LIMITS).reason is Reason.SHORT


def test_fixed_costs_are_priced_on_both_sides():
    # Same pace both sides; decode's turns cost 40 ms beyond their tokens, prefill's legs 20 ms
    # and a 30 ms hand-off: decode is sooner by 10 ms.
    with_fixed = PrefillLoad(0.1 * MS, 0, 30 * MS, fixed_s=20 * MS)
    p = place(1500, with_fixed, decode(fixed_ms=40), LIMITS)
    assert p.local and p.decode_s == pytest.approx(0.19) and p.prefill_s == pytest.approx(0.2)
    q = place(1500, with_fixed, decode(fixed_ms=60), LIMITS)
    assert not q.local and q.reason is Reason.LATER
    # An unmeasured replica takes prefill's fixed cost and pace, plus the hand-off: never sooner
    # while prefill is idle.
    r = place(1500, with_fixed, decode(pace=None), LIMITS)
    assert r.decode_s == pytest.approx(0.02 + 0.15 + 0.03) and not r.local


# -- what feeds it: the line through legs, late outputs -------------------------------------------


def test_a_pools_legs_give_a_fixed_cost_and_a_cost_per_token():
    pace = LegPace()
    assert pace.cost() == LegCost(0.0, None, 0.0)
    for tokens in (100, 2000, 300, 1500, 800, 120, 1800, 600):
        pace.observe(tokens, 0.04 + 0.0002 * tokens)
    fixed, per_token, per_context = pace.cost()
    assert fixed == pytest.approx(0.04, rel=0.05) and per_token == pytest.approx(0.0002, rel=0.05)
    assert per_context == 0.0  # every leg over no history: nothing to tell the term apart
    # The pace per token alone (kept for deadlines) carries the fixed cost of short legs.
    assert pace.seconds_per_token > 0.0002 * 1.05


def test_legs_over_histories_give_a_cost_per_token_of_context():
    # A CPU engine: 5 ms a leg, 75 us a token, 48 ns a token per token of history.
    pace = LegPace()
    legs = [(1100, 0), (120, 3000), (300, 6000), (90, 1500), (800, 4000), (1000, 0), (200, 8000), (150, 500)]
    for _ in range(2):
        for new, context in legs:
            pace.observe(new, 0.005 + 75e-6 * new + 48e-9 * new * context, context_tokens=context)
    cost = pace.cost()
    assert cost.fixed == pytest.approx(0.005, rel=0.05)
    assert cost.per_token == pytest.approx(75e-6, rel=0.05)
    assert cost.per_context == pytest.approx(48e-9, rel=0.05)
    assert cost.per_token + 5000 * cost.per_context == pytest.approx(75e-6 + 5000 * 48e-9, rel=0.05)
    # The line through tokens alone would price a first turn at the long histories' pace.
    line_only = LegPace()
    for _ in range(2):
        for new, context in legs:
            line_only.observe(new, 0.005 + 75e-6 * new + 48e-9 * new * context)
    assert line_only.cost().per_context == 0.0


def test_a_first_turn_is_priced_without_the_histories_attention():
    # The replica's turns ran over long histories (0.3 ms a token there); a first turn
    # attends over nothing, so it is as quick there as on prefill and skips the hand-off.
    over_history = DecodeLoad(75e-6, 0, 0, None, 0.005, 0, seconds_per_context=48e-9)
    prefill = PrefillLoad(75e-6, 0, 30 * MS, 0.005, 48e-9)
    first = place(1100, prefill, over_history, LIMITS, context=0)
    assert first.local and first.reason is Reason.SOONER
    assert first.decode_s == pytest.approx(0.005 + 1100 * 75e-6)
    # Over a 5k history each of its chunks stalls the replica's streams past the target.
    streaming = DecodeLoad(75e-6, 0, 2, 10 * MS, 0.005, 0, seconds_per_context=48e-9)
    long = place(1100, prefill, streaming, LIMITS, context=5000)
    assert long.reason is Reason.ITL
    assert long.stream_step_s == pytest.approx(0.010 + (75e-6 + 5000 * 48e-9) * 256)
    # Over no history the same chunks fit the target (the streams' steps are priced in
    # its first token instead).
    first_streaming = place(1100, prefill, streaming, LIMITS, context=0)
    assert first_streaming.reason is not Reason.ITL and first_streaming.late_outputs == 0
    assert first_streaming.stream_step_s == pytest.approx(0.010 + 75e-6 * 256)


def test_legs_of_one_size_give_no_line_and_the_pace_stands_in():
    pace = LegPace()
    for _ in range(20):
        pace.observe(500, 0.15)
    assert pace.line.fit() is None
    assert pace.cost() == (0.0, pytest.approx(0.15 / 500), 0.0)
    few = LineFit()
    for tokens in (100, 2000, 300):
        few.observe(tokens, 0.04 + 0.0002 * tokens)
    assert few.fit() is None  # fewer than MIN_LEGS


def test_late_outputs_give_a_budget_over_a_window():
    late = LateTokens(target_s=50 * MS, fraction=0.01, window=400)
    assert late.budget == 0  # nothing earned yet
    for _ in range(300):
        late.observe(10 * MS)
    assert late.budget == 3 and late.seen == 300  # 1% of what was seen, none late
    late.observe(80 * MS)
    assert late.late == 1 and late.budget == 2  # floor(3.01) - 1
    for _ in range(5):
        late.observe(60 * MS)
    assert late.budget == 3 - 6
    for _ in range(400):  # the window moves past them
        late.observe(10 * MS)
    assert late.late == 0 and late.seen == 400 and late.budget == 4
    # Late means past 80% of the target where the ingress sees it: the client sees it later.
    late.observe(39 * MS)
    assert late.late == 0
    late.observe(41 * MS)
    assert late.late == 1


def test_a_steps_outputs_count_as_that_many_outputs_one_by_one():
    """`observe_many` (a step's outputs at once, as the simulation reports them) leaves
    the window, the late count and the pace exactly where as many `observe`s would."""
    one, many = LateTokens(50 * MS, 0.01, window=50), LateTokens(50 * MS, 0.01, window=50)
    pace_one, pace_many = Ewma(), Ewma()
    for gap, count in [(10 * MS, 7), (60 * MS, 3), (20 * MS, 0), (45 * MS, 30), (10 * MS, 45), (90 * MS, 80)]:
        for _ in range(count):
            one.observe(gap)
            pace_one.observe(gap)
        many.observe_many([gap], count)
        pace_many.observe_many([gap], count)
        assert (many.late, many.seen, many.budget) == (one.late, one.seen, one.budget)
        assert pace_many.value == pace_one.value
    assert one.late == 50  # the last step filled the window with late outputs
    steps = [10 * MS, 12 * MS, 41 * MS, 45 * MS, 30 * MS, 60 * MS]  # several steps at once
    for gap in steps:
        for _ in range(4):
            one.observe(gap)
            pace_one.observe(gap)
    many.observe_many(steps, 4)
    pace_many.observe_many(steps, 4)
    assert (many.late, many.seen, pace_many.value) == (one.late, one.seen, pace_one.value)
    assert many.late == 3 * 4 + (50 - 24)  # this call's, and the last step's still in the window


# -- the static rule (transfer.placement: static) -----------------------------------------------


def test_the_static_rule_ignores_the_streams():
    over = decode(streams=30, step_ms=60)
    assert place_static(300, PREFILL, over, LIMITS).reason is Reason.SHORT
    assert place_static(1500, PREFILL, decode(), LIMITS).reason is Reason.IDLE
    busy = PrefillLoad(0.1 * MS, tokens_in_flight=2000)
    assert place_static(1500, busy, over, LIMITS).reason is Reason.BUSY
    assert place_static(1500, busy, decode(pace=1 * MS), LIMITS).reason is Reason.LATER
    assert place_static(3000, busy, decode(), LIMITS).reason is Reason.TOO_LONG
    assert place_static(1500, busy, None, LIMITS).reason is Reason.NO_REPLICA


def test_every_reason_has_its_counter():
    assert {f"placed_{r}" for r in Reason} <= {c.value for c in TurnCount}


# -- the decode engines' chunked prefill ---------------------------------------------------------


def config(**transfer) -> AppConfig:
    return AppConfig.from_args({"model": "m", "max_model_len": 4096, "transfer": transfer})


def test_decode_engines_compute_prompts_in_chunks_and_prefill_engines_only_when_hosting():
    from app.engines.setup import decode_chunking, decode_prompt_chunk

    cfg = config(decode_chunk_tokens=192)
    assert decode_chunking(cfg, cfg.decode) == {
        "long_prefill_token_threshold": 192,
        "max_num_batched_tokens": 192 + 128,
    }
    assert decode_chunking(cfg, cfg.prefill) == {}
    assert decode_prompt_chunk(cfg) == 192
    # The role as a Serve replica gets it (its constructor arguments in one pickle).
    bound, role = pickle.loads(pickle.dumps((cfg, cfg.decode)))
    assert decode_chunking(bound, role)["long_prefill_token_threshold"] == 192
    # A prefill engine that hosts sessions streams answers too: it chunks as decode does.
    hosts = config(decode_chunk_tokens=192, prefill_hosts=True)
    assert hosts.prefill_hosts and decode_chunking(hosts, hosts.prefill) == decode_chunking(
        hosts, hosts.decode
    )


def test_chunking_follows_the_roles_own_engine_args_and_can_be_off():
    from app.engines.setup import decode_chunking, decode_prompt_chunk

    seqs = AppConfig.from_args({"model": "m", "decode": {"engine_kwargs": {"max_num_seqs": 64}}})
    assert decode_chunking(seqs, seqs.decode)["max_num_batched_tokens"] == 256 + 64
    own = AppConfig.from_args({"model": "m", "decode": {"engine_kwargs": {"max_num_batched_tokens": 512}}})
    assert decode_chunking(own, own.decode) == {} and decode_prompt_chunk(own) == 512
    off = config(decode_chunk_tokens=0)
    assert decode_chunking(off, off.decode) == {} and decode_prompt_chunk(off) == 0
    single = AppConfig.from_args({"model": "m", "mode": "single"})
    assert decode_chunking(single, single.decode) == {} and decode_prompt_chunk(single) == 0


def test_defaults_are_the_fleet_target_and_the_priced_rule():
    t = AppConfig.from_args({"model": "m"}).transfer
    assert (t.placement, t.itl_target_ms, t.decode_chunk_tokens) == ("priced", 50.0, 256)


# -- the stream counts that feed it ---------------------------------------------------------------


class Engines:
    def __init__(self):
        self.replica = "decode-0"

    async def decode(self, request: EngineRequest):
        for i in range(3):
            yield EngineChunk(token_ids=(i,), text="x", finished=i == 2), self.replica

    def decode_alive(self, replica_id: str) -> bool | None:
        return True


def request(kv_params) -> EngineRequest:
    return EngineRequest("r", (1, 2, 3), Sampling(max_tokens=3), kv_params=kv_params)


async def test_streams_are_counted_on_their_replica_while_they_stream():
    streams = DecodeStreams()
    clients = streams.watch(Engines())
    assert clients.decode_alive("decode-0") is True  # everything else passes through
    seen = []
    async for _, replica in clients.decode(request(local_decode_params())):
        seen.append(streams.of(replica).streams)
    assert seen == [1, 1, 1] and streams.of("decode-0").streams == 0
    assert streams.of("decode-0").seconds_per_token.value is not None
    assert streams.of("decode-0").late.seen == 2  # the gaps between 3 outputs, none late
    assert streams.handoff.value is None  # computed on decode: no hand-off
    assert streams.of("decode-0").joined_per_s(time.monotonic()) == 0.0  # started alone
    first = clients.decode(request(local_decode_params()))
    await anext(first)  # a stream streaming ...
    async for _ in clients.decode(request(local_decode_params())):  # ... and one beside it
        pass
    await first.aclose()
    assert streams.of("decode-0").streams == 0
    assert streams.of("decode-0").joined_per_s(time.monotonic()) > 0.0


async def test_a_pd_turns_first_output_is_its_hand_off_and_a_broken_stream_is_uncounted():
    streams = DecodeStreams()
    handle = KVHandle(Location.PREFILL, "p-0", "req", ((1, 2),), "127.0.0.1", 5600, 32)
    clients = streams.watch(Engines())
    stream = clients.decode(request(handle.to_wire()))
    await anext(stream)
    assert streams.handoff.value is not None and streams.of("decode-0").streams == 1
    await stream.aclose()  # the client went away mid-answer
    assert streams.of("decode-0").streams == 0


# -- the ingress's choice, with its counters ------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    return str(path)


@pytest.mark.parametrize("policy", ["priced", "static"])
async def test_a_short_turn_skips_a_replica_whose_streams_are_at_the_target_unless_static(model_dir, policy):
    from app.turn.pacing import LegPace
    from tests.test_turns import P1, USER2, Rig

    rig = Rig(model_dir, **{"transfer.decode_local_tokens": 64, "transfer.placement": policy})
    text1, _, r1 = await rig.turn(text=P1)  # a short first turn: decode-local
    assert rig.turns.counts["placed_short"] == 1 and rig.engines.prefill_requests == []
    # Its replica now streams 3 answers at 60 ms a token and computes prompts at 1 ms a token.
    replica = r1.decode_replica
    rig.turns.local_pace[replica] = LegPace()
    rig.turns.local_pace[replica].seconds_per_token = 0.001
    streams = rig.turns.streams.of(replica)
    streams.streams = 3
    streams.seconds_per_token.value = 0.060
    for _ in range(20):  # their outputs came late: more than their share of the window
        streams.late.observe(0.060)
    assert streams.late.budget < 0
    await rig.turn(text=P1 + text1 + USER2)
    counts = rig.turns.counts
    if policy == "priced":
        assert counts["placed_itl"] == 1 and counts["decode_local"] == 1
        assert len(rig.engines.prefill_requests) == 1 and len(rig.engines.pulls) == 1
    else:
        assert counts["placed_short"] == 2 and counts["decode_local"] == 2
        assert rig.engines.prefill_requests == []
    assert streams.streams == 3  # the turn's own stream came and went


async def test_a_new_session_is_priced_on_the_least_loaded_replica_and_goes_there(model_dir):
    from app.turn.pacing import LegPace
    from tests.test_turns import P1, FakeTokenizer, Rig

    rig = Rig(model_dir, **{"transfer.decode_local_tokens": 4})
    assert len(FakeTokenizer().encode(P1)) > 4  # longer than "short"
    # Nothing measured: a long first prompt goes through prefill, as before.
    _, _, first = await rig.turn(text=P1, session="a")
    assert rig.turns.counts["placed_later"] == 1 and len(rig.engines.prefill_requests) == 1
    assert first.placement == "later"
    # Both replicas measured computing alone as fast as prefill; decode-0 has a stream running.
    rig.turns.pace.seconds_per_token = 0.001
    for replica in rig.engines.replica_ids:
        rig.turns.local_pace[replica] = LegPace()
        rig.turns.local_pace[replica].seconds_per_token = 0.001
    rig.turns.streams.handoff.value = 0.030
    rig.turns.streams.of("decode-0").streams = 1
    _, _, r = await rig.turn(text=P1, session="b")
    assert rig.turns.counts["placed_sooner"] == 1 and len(rig.engines.prefill_requests) == 1
    assert r.decode_replica == "decode-1"  # the idle one, named as the preferred replica
    assert r.placement == "sooner"
    assert rig.turns.local_pace["decode-1"].tokens_in_flight == 0  # its leg was paced and ended


def test_placement_choices_are_exported_by_route_and_reason():
    from app.api import metrics
    from tests.test_metrics import recording

    m = recording(metrics.TurnMetrics("bidir"))
    m.sync_events({"placed_short": 2, "placed_itl": 1})
    m.sync_events({"placed_short": 3, "placed_itl": 1, "placed_sooner": 1})
    assert m.placements.get(route="decode", reason="short") == 3
    assert m.placements.get(route="decode", reason="sooner") == 1
    assert m.placements.get(route="prefill", reason="itl") == 1
    assert m.events.get(event="placed_itl") == 1  # and among the turn events, as every counter
