"""`app.api.metrics`: what each recording helper exports, with the Ray metric objects
replaced by recorders (creating and recording real ones without Ray is a no-op)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import pytest

from app.api import metrics
from app.turn.events import Continuation


class Recorder:
    """Stands in for a ray.util.metrics object: sums `inc`, keeps the last `set`,
    lists `observe` values, each per tag set."""

    def __init__(self):
        self.values = defaultdict(float)
        self.observed = defaultdict(list)

    def _key(self, tags):
        return tuple(sorted((tags or {}).items()))

    def inc(self, value=1.0, tags=None):
        assert value > 0, "Ray's Counter.inc refuses values <= 0"
        self.values[self._key(tags)] += value

    def set(self, value, tags=None):
        self.values[self._key(tags)] = value

    def observe(self, value, tags=None):
        self.observed[self._key(tags)].append(value)

    def get(self, **tags):
        return self.values.get(self._key(tags))


def recording(obj):
    for name, value in list(vars(obj).items()):
        if type(value).__module__.startswith("ray.util.metrics"):
            setattr(obj, name, Recorder())
    return obj


def result(**kw):
    base = dict(
        prompt_tokens=500,
        cached_tokens=320,
        reused_from_decode=288,
        miss_reason=None,
        timings={"first_token_s": 0.42},
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "index, bucket",
    [
        (None, "unknown"),
        (0, "unknown"),
        (1, "1"),
        (2, "2"),
        (3, "3-4"),
        (4, "3-4"),
        (8, "5-8"),
        (16, "9-16"),
        (17, "17+"),
    ],
)
def test_turn_bucket(index, bucket):
    assert metrics.turn_bucket(index) == bucket


def test_chat_turn_index_counts_assistant_messages():
    msgs = [SimpleNamespace(role=r) for r in ("system", "user", "assistant", "tool", "assistant", "user")]
    assert metrics.chat_turn_index(msgs) == 3
    assert metrics.chat_turn_index([SimpleNamespace(role="user")]) == 1
    assert metrics.chat_turn_index([{"role": "user"}, {"role": "assistant"}, {"role": "user"}]) == 2


def test_record_turn_splits_prompt_tokens():
    m = recording(metrics.TurnMetrics("bidir"))
    m.record_turn(result(), 2)
    m.record_turn(
        result(prompt_tokens=100, cached_tokens=0, reused_from_decode=0, miss_reason="no_conversation"), 1
    )
    t2 = {"mode": "bidir", "turn": "2"}
    assert m.pulled.get(**t2) == 288 and m.cached.get(**t2) == 320 and m.computed.get(**t2) == 180
    assert m.prompt_tokens.get(**t2) == 500 and m.turns.get(**t2) == 1
    assert m.ttft.observed[m.ttft._key(t2)] == [0.42]
    assert m.computed.get(mode="bidir", turn="1") == 100
    assert m.misses.values == {m.misses._key({"mode": "bidir", "reason": "no_conversation"}): 1}


def test_turn_hops_split_the_time_to_first_token():
    timings = {
        "store_s": 0.002,
        "session_s": 0.005,
        "prefill_queue_s": 0.001,
        "prefill_engine_s": 0.100,
        "prefill_s": 0.120,
        "decode_queue_s": 0.0,
        "decode_engine_s": 0.030,
        "first_token_s": 0.160,
    }
    hops = metrics.turn_hops(timings)
    assert hops == pytest.approx(
        {
            "store": 0.002,
            "verify": 0.003,
            "prefill_engine": 0.100,
            "prefill_transport": 0.015,
            "decode_engine": 0.030,
            "decode_transport": 0.010,
        }
    )
    assert sum(hops.values()) == pytest.approx(timings["first_token_s"])
    # One engine (single mode): no prefill leg, decode's span starts after the session.
    single = metrics.turn_hops(
        {"store_s": 0.001, "session_s": 0.002, "decode_engine_s": 0.05, "first_token_s": 0.06}
    )
    assert single == pytest.approx(
        {"store": 0.001, "verify": 0.001, "decode_engine": 0.05, "decode_transport": 0.008}
    )
    # A leg without the engine's stats (a failed prefill) leaves its hops out.
    assert "prefill_engine" not in metrics.turn_hops(
        {"store_s": 0.0, "session_s": 0.0, "prefill_s": 0.2, "first_token_s": 0.3}
    )


def test_record_turn_observes_each_hop():
    m = recording(metrics.TurnMetrics("bidir"))
    timings = {"store_s": 0.002, "session_s": 0.004, "decode_engine_s": 0.05, "first_token_s": 0.06}
    m.record_turn(result(timings=timings), 1)
    assert m.hops.observed[m.hops._key({"mode": "bidir", "hop": "decode_engine"})] == [0.05]
    assert len(m.hops.observed) == 4


def test_sync_events_exports_growth_only():
    m = recording(metrics.TurnMetrics("bidir"))
    m.sync_events({"spliced": 2, "pull_timeout": 1})
    m.sync_events({"spliced": 2, "pull_timeout": 3, "decode_retried": 1})
    assert m.events.get(event="spliced") == 2 and m.events.get(event="pull_timeout") == 3
    assert m.events.get(event="decode_retried") == 1
    assert m.pull_timeouts.get() == 3


def test_continuations_export_by_how_and_failed_replica_not_as_events():
    m = recording(metrics.TurnMetrics("bidir"))
    how = Continuation.RESUMED
    m.sync_events({"decode_continued": 1, how.of_replica("r1"): 1})
    m.sync_events(
        {"decode_continued": 3, how.of_replica("r1"): 2, Continuation.REPLAYED_GRAMMAR.of_replica(None): 1}
    )
    assert m.events.get(event="decode_continued") == 3
    assert m.continuations.get(how="resumed", replica="r1") == 2
    assert m.continuations.get(how="replayed_grammar", replica="unknown") == 1
    assert m.events.get(event=how.of_replica("r1")) is None


def test_store_gauges_sum_shards_and_zero_states_that_left():
    g = recording(metrics.StoreGauges())
    shard = {
        "sessions": 3,
        "handles": {"stored": 2, "claimed": 1},
        "claimed_handles": 1,
        "pinned_blocks": {"d-1": 12},
        "counts": {"pulled": 4},
    }
    g.update(
        {
            "shards": [
                shard,
                {
                    "sessions": 1,
                    "handles": {"stored": 1},
                    "pinned_blocks": {"d-2": 3},
                    "counts": {"pulled": 1},
                },
            ]
        }
    )
    assert g.handles.get(state="stored") == 3 and g.handles.get(state="claimed") == 1
    assert g.sessions.get() == 4 and g.claimed.get() == 1
    assert g.pinned.get(engine="d-1") == 12 and g.pinned.get(engine="d-2") == 3
    assert g.exits.get(exit="pulled") == 5
    g.update({"shards": [{"sessions": 0, "handles": {}}]})
    assert g.handles.get(state="stored") == 0 and g.handles.get(state="claimed") == 0


async def test_poll_exports_events_and_store_state_in_the_background():
    m = recording(metrics.TurnMetrics("bidir"))
    recording(m.store)
    calls = []

    async def stats():
        calls.append(1)
        return {"shards": [{"sessions": 7}]}

    counts = {"prefill_failed": 2}
    m.ensure_polling(counts, stats)
    m.ensure_polling(counts, stats)  # one task only
    await asyncio.sleep(0.05)
    assert calls == [1] and m.store.sessions.get() == 7
    assert m.events.get(event="prefill_failed") == 2
    m._task.cancel()


async def test_timed_store_times_calls_and_counts_failures():
    class Store:
        async def begin_turn(self, session_id):
            return session_id.upper()

        async def end_turn(self, *args):
            raise RuntimeError("actor died")

        shards = 3

    timed = metrics.TimedStore(Store())
    timed._latency, timed._errors = Recorder(), Recorder()
    assert await timed.begin_turn("s") == "S"
    with pytest.raises(RuntimeError):
        await timed.end_turn(1, 2, 3)
    assert timed.shards == 3
    assert len(timed._latency.observed[timed._latency._key({"op": "begin_turn"})]) == 1
    assert len(timed._latency.observed[timed._latency._key({"op": "end_turn"})]) == 1
    assert timed._errors.values == {timed._errors._key({"op": "end_turn"}): 1}


def test_engine_metrics_blocks_and_transfers():
    e = recording(metrics.EngineMetrics("decode", "decode-r1-abc"))
    tags = {"role": "decode", "engine": "decode-r1-abc"}
    e.record_step(kv_cache_usage=0.25, num_blocks=400, running=0, transfer_stats=None)
    assert (
        e.blocks_in_use.get(**tags) == 100
        and e.blocks_total.get(**tags) == 400
        and e.running.get(**tags) == 0
    )
    stats = {
        "transfer_duration": [0.01, 0.03],
        "bytes_transferred": [1000, 3000],
        "num_failed_transfers": [1],
    }
    e.record_step(kv_cache_usage=0.0, num_blocks=400, running=1, transfer_stats=stats)
    e.record_step(
        kv_cache_usage=0.0,
        num_blocks=400,
        running=1,
        transfer_stats={"transfer_duration": [0.02], "bytes_transferred": [500]},
    )
    assert e.transfers.get(**tags) == 3 and e.transfer_bytes.get(**tags) == 4500
    assert e.transfer_seconds.get(**tags) == pytest.approx(0.06) and e.failed_transfers.get(**tags) == 1
    assert e.blocks_in_use.get(**tags) == 0


def test_real_metrics_without_ray_are_noops():
    """Every kind of record (counter, gauge, histogram) on the real Ray metric objects,
    outside Ray: nothing raises or warns (an invalid name or tag would), and nothing
    starts or connects to Ray: no Ray session, no new thread, no new process."""
    import threading
    import warnings

    import psutil
    import ray

    assert not ray.is_initialized()
    me = psutil.Process()
    threads = {t.ident for t in threading.enumerate()}
    children = {p.pid for p in me.children(recursive=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        turns = metrics.TurnMetrics("oneway")
        engine = metrics.EngineMetrics("prefill", "p")
        assert type(turns.turns).__module__ == type(engine.running).__module__ == "ray.util.metrics"
        turns.record_turn(
            result(
                miss_reason="no_handle", timings={"first_token_s": 0.42, "store_s": 0.01, "session_s": 0.02}
            ),
            3,
            tenant="t1",
        )
        turns.record_turn(result(), None)
        turns.sync_events({"pull_timeout": 2, "spliced": 1})
        turns.sync_refusals({("t1", "rpm"): 1})
        turns.store.update(
            {
                "handles": {"idle": 2},
                "sessions": 1,
                "pinned_blocks": {"d": 4},
                "tenants": {"t1:": {"blocks": 4}},
            }
        )
        engine.record_step(
            kv_cache_usage=0.5,
            num_blocks=10,
            running=1,
            transfer_stats={
                "transfer_duration": [0.1],
                "bytes_transferred": [4096],
                "num_failed_transfers": [1],
            },
        )
        engine.record_step(kv_cache_usage=0.0, num_blocks=None, running=0, transfer_stats=None)
    assert not ray.is_initialized()
    assert {t.ident for t in threading.enumerate()} <= threads
    assert {p.pid for p in me.children(recursive=True)} <= children
