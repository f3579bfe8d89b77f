"""Early release of decode-pinned KV (`connector.release`) and the ingress side that drives
it (`app.fleet.memory.DecodeMemory`). No engines: the worker-side expiry is checked against
vLLM's own reaping code, the rest with fakes of the store and the decode replicas."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from app.config import AppConfig
from app.fleet.memory import DecodeMemory
from connector import release
from connector.handle import KVHandle, Location
from connector.patching import Unsupported
from connector.settings import StoreSettings
from connector.store import Conversation, TurnOutcome

# -- worker side ------------------------------------------------------------------------


def test_installed_vllm_has_what_release_needs():
    release.check_support()  # raises Unsupported naming what is missing


@pytest.mark.parametrize(
    "module, cls, attribute",
    [
        (
            "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
            "NixlBaseConnectorWorker",
            "_reqs_to_send",
        ),
        ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector", "NixlConnector", "connector_worker"),
        ("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector", "MultiConnector", "_connectors"),
        ("vllm.v1.core.sched.scheduler", "Scheduler", "kv_cache_manager"),
        ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "block_pool"),
        ("vllm.v1.core.block_pool", "BlockPool", "num_gpu_blocks"),
    ],
)
def test_support_check_fails_when_vllm_no_longer_sets_the_state_release_uses(
    monkeypatch, module, cls, attribute
):
    """`expire_sends`, `nixl_worker_of` and `block_counts` read and write state that vLLM's
    constructors set: a vLLM whose constructors (the class's and its bases') stop setting
    it is refused, by name."""
    import importlib

    def __init__(self, *args, **kwargs):
        self.something_else = None

    for klass in getattr(importlib.import_module(module), cls).__mro__:
        if "__init__" in klass.__dict__ and klass is not object:
            monkeypatch.setattr(klass, "__init__", __init__)
    with pytest.raises(Unsupported, match=repr(attribute)):
        release.check_support()


def test_support_check_fails_when_vllm_lacks_a_method_release_calls(monkeypatch):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.delattr(KVCacheManager, "get_block_ids")
    with pytest.raises(Unsupported, match="get_block_ids"):
        release.check_support()


def _real_pull_scheduler(bidirectional: bool = True):
    """A subclass of the installed vLLM's NixlConnector pull scheduler, patched by
    `track_local_decode_pins`, with only the state `update_state_after_alloc` reads."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    class Scheduler(NixlPullConnectorScheduler):
        pass

    release.track_local_decode_pins(Scheduler)
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.is_bidirectional_kv_xfer_enabled = bidirectional
    scheduler.use_host_buffer = False
    scheduler._reqs_in_batch = set()
    scheduler._reqs_need_recv = {}
    scheduler._reqs_need_save = {}
    return scheduler


@pytest.mark.parametrize(
    "params, tracked",
    [
        ({"do_remote_prefill": False, "do_remote_decode": False}, True),  # local_decode_params()
        (
            {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": None},
            True,
        ),  # vLLM's own
        (None, False),  # no connector params: blocks are freed at once, nothing to track
        ({}, False),
    ],
)
def test_decode_request_that_computes_its_prompt_is_tracked_like_a_reader(params, tracked):
    """Without the patch vLLM 0.32 leaves a decode-local request out of the batch its
    worker tracks, and its pinned blocks never expire (seen on a soak: 1,511 blocks past
    the TTL on an idle engine)."""
    scheduler = _real_pull_scheduler()
    request = SimpleNamespace(request_id="r1", kv_transfer_params=params)
    scheduler.update_state_after_alloc(
        request, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ()), 0
    )
    assert ("r1" in scheduler._reqs_in_batch) is tracked


def test_local_decode_requests_not_tracked_without_bidirectional_transfer():
    scheduler = _real_pull_scheduler(bidirectional=False)
    request = SimpleNamespace(
        request_id="r1", kv_transfer_params={"do_remote_prefill": False, "do_remote_decode": False}
    )
    scheduler.update_state_after_alloc(request, None, 0)
    assert scheduler._reqs_in_batch == set()


def test_tracking_patch_wraps_once():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    class Scheduler(NixlPullConnectorScheduler):
        pass

    release.track_local_decode_pins(Scheduler)
    first = Scheduler.update_state_after_alloc
    release.track_local_decode_pins(Scheduler)
    assert Scheduler.update_state_after_alloc is first


def _real_nixl_worker(pins: dict[str, float]):
    """A NixlConnector worker of the installed vLLM with only the state its send-lease
    reaping reads (no NIXL agent, no engine)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    worker = NixlBaseConnectorWorker.__new__(NixlBaseConnectorWorker)
    worker._reqs_to_send = dict(pins)
    worker._reqs_to_process = set(pins)
    worker.consumer_notification_counts_by_req = Counter()
    worker.expected_consumer_notifications_by_req = {}
    worker.xfer_stats = SimpleNamespace(expired=0)
    worker.xfer_stats.record_kv_expired_req = lambda: setattr(
        worker.xfer_stats, "expired", worker.xfer_stats.expired + 1
    )
    return worker


def test_expired_pin_is_reported_finished_by_vllms_own_reaping():
    far = time.perf_counter() + 480
    worker = _real_nixl_worker({"a": far, "b": far, "c": far})
    assert release.expire_sends(worker, ["a", "c", "not-pinned"]) == ["a", "c"]
    done: set[str] = set()
    worker._reap_expired_send_leases(done)
    # The scheduler frees the blocks of every request reported finished sending.
    assert done == {"a", "c"}
    assert set(worker._reqs_to_send) == {"b"} and worker._reqs_to_process == {"b"}
    assert worker.xfer_stats.expired == 2


def test_nixl_worker_found_alone_or_inside_a_multi_connector():
    nixl = SimpleNamespace(_reqs_to_send={})
    direct = SimpleNamespace(connector_worker=nixl)
    offload = SimpleNamespace(connector_worker=SimpleNamespace())
    multi = SimpleNamespace(_connectors=[offload, direct])
    assert release.nixl_worker_of(direct) is nixl
    assert release.nixl_worker_of(multi) is nixl
    assert release.nixl_worker_of(offload) is None


def test_block_counts_from_the_block_pool():
    finished = SimpleNamespace(is_finished=lambda: True)
    running = SimpleNamespace(is_finished=lambda: False)
    blocks = {"pinned-1": ([1, 2, 3],), "pinned-2": ([3, 4],), "running": ([5, 6],)}
    scheduler = SimpleNamespace(
        requests={"pinned-1": finished, "pinned-2": finished, "running": running},
        kv_cache_manager=SimpleNamespace(
            block_pool=SimpleNamespace(num_gpu_blocks=101, get_num_free_blocks=lambda: 94),
            get_block_ids=lambda request_id: blocks[request_id],
        ),
    )
    # Shared prefix blocks count once; the pool's null block is not usable.
    assert release.block_counts(scheduler) == {"total": 100, "free": 94, "pinned": 4, "pinned_requests": 2}


def test_register_is_inert_unless_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(release, "install", lambda *a: calls.append(a))
    monkeypatch.delenv(release.ENV_RELEASE, raising=False)
    release.register()
    assert calls == []
    monkeypatch.setenv(release.ENV_RELEASE, "1")
    release.register()
    assert len(calls) == 1


def test_install_adds_the_two_entry_points():
    class Worker:
        pass

    class Core:
        pass

    release.install(Worker, Core)
    assert callable(getattr(Worker, release.WORKER_EXPIRE))
    assert callable(getattr(Core, release.CORE_BLOCKS))


# -- ingress side -------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeRelease:
    engine_id: str
    request_id: str
    decode_replica: str | None
    num_blocks: int
    reason: str


class FakeMemoryStore:
    def __init__(self):
        self.outbox: list[FakeRelease] = []

    async def take_releases(self) -> list[FakeRelease]:
        out, self.outbox = self.outbox, []
        return out


class FakeDecodeReplicas:
    def __init__(self, pinned: dict[str, set[str]], dead=()):
        self.pinned = pinned  # replica -> request ids it pins
        self.dead = set(dead)
        self.calls: list[tuple[str, list[str]]] = []
        self.block_queries = 0

    async def decode_kv_blocks(self, replica_id: str) -> dict:
        self.block_queries += 1
        return {
            "engine_id": f"engine-{replica_id}",
            "total": 300,
            "free": 250,
            "pinned": 10,
            "pinned_requests": 1,
        }

    async def release(self, replica_id: str, request_ids) -> list[str]:
        self.calls.append((replica_id, list(request_ids)))
        held = self.pinned.get(replica_id, set())
        done = [r for r in request_ids if r in held]
        held.difference_update(done)
        return done

    def decode_alive(self, replica_id: str) -> bool | None:
        return replica_id not in self.dead

    def decode_replicas(self) -> frozenset[str] | None:
        return frozenset(self.pinned) - self.dead


class CapacityStore(FakeMemoryStore):
    def __init__(self):
        super().__init__()
        self.capacity: dict[str, int] = {}

    async def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        self.capacity[engine_id] = total_blocks


def conversation(replica: str, engine: str) -> Conversation:
    handle = KVHandle(Location.DECODE, engine, "req", ((1, 2),), "127.0.0.1", 5600, 40)
    return Conversation("s", (1, 2, 3), 2, handle=handle, decode_replica=replica)


def conversation_on(engine: str, session: str, request_id: str) -> Conversation:
    handle = KVHandle(Location.DECODE, engine, request_id, ((1, 2),), "127.0.0.1", 5600, 40)
    return Conversation(session, (1, 2, 3), 2, handle=handle, decode_replica="d0")


async def test_releases_go_to_their_replicas_grouped():
    store = FakeMemoryStore()
    replicas = FakeDecodeReplicas({"d0": {"r1", "r2"}, "d1": {"r3"}}, dead={"d2"})
    counts: Counter = Counter()
    memory = DecodeMemory(cfg_for_memory(), replicas, store, counts)
    store.outbox = [
        FakeRelease("e0", "r1", "d0", 5, "evicted"),
        FakeRelease("e0", "r2", "d0", 7, "superseded"),
        FakeRelease("e1", "r3", "d1", 3, "ended"),
        FakeRelease("e1", "gone", "d1", 2, "expired"),
        FakeRelease("e2", "r4", "d2", 9, "evicted"),
    ]
    assert await memory.flush() == 3
    assert sorted(replicas.calls) == [("d0", ["r1", "r2"]), ("d1", ["r3", "gone"])]
    assert counts["released_requests"] == 3 and counts["released_blocks"] == 15
    assert counts["release_not_pinned"] == 1 and counts["release_replica_gone"] == 1
    assert counts["release_evicted"] == 2 and counts["release_ended"] == 1
    assert await memory.flush() == 0 and len(replicas.calls) == 2


async def test_capacity_asked_once_per_engine_and_given_with_every_turn():
    store = FakeMemoryStore()
    replicas = FakeDecodeReplicas({})
    memory = DecodeMemory(cfg_for_memory(), replicas, store, Counter())
    assert await memory.capacity_of(conversation("d0", "engine-d0")) == 300
    assert await memory.capacity_of(conversation("d0", "engine-d0")) == 300
    assert replicas.block_queries == 1
    # A replica that now runs another engine than the handle's: nothing learned.
    counts = memory.counts
    assert await memory.capacity_of(conversation("d1", "engine-old")) is None
    assert counts["capacity_unknown"] == 1


async def test_live_engines_capacity_synced_to_the_store_even_without_turns():
    """A replacement decode replica that served no turn yet, and a store that restarted:
    the periodic sync asks each live replica once and tells the store every engine."""
    replicas = FakeDecodeReplicas({"d0": set(), "d1": set()})
    store = CapacityStore()
    memory = DecodeMemory(cfg_for_memory(), replicas, store, Counter())
    assert await memory.sync_capacities() == 2
    assert store.capacity == {"engine-d0": 300, "engine-d1": 300} and replicas.block_queries == 2
    store.capacity.clear()  # the store restarted, empty
    replicas.dead.add("d1")  # and d1 went away
    assert await memory.sync_capacities() == 1
    assert store.capacity == {"engine-d0": 300} and replicas.block_queries == 2  # nobody asked twice


def test_restarted_store_learns_the_budget_from_the_next_turn():
    """A shard restarted by Ray starts empty; the ingress learned each engine's block count
    once and does not ask again, so the count travels with every stored turn."""

    def turn(store, session, request_id, blocks):
        claim = store.begin_turn(session)
        store.end_turn(claim.lease_id, TurnOutcome.UNUSED, conversation_on("e0", session, request_id), blocks)

    settings = StoreSettings(
        handle_ttl_s=100,
        decoder_ttl_s=200,
        max_sessions=100,
        max_blocks_per_engine=10_000,
        index_block_size=32,
    )
    store = settings.handle_store()
    turn(store, "a", "r1", 300)
    assert store.stats()["pin_budgets"] == {"e0": 150}
    restarted = settings.handle_store()
    assert restarted.stats()["pin_budgets"] == {}
    turn(restarted, "b", "r2", 300)
    assert restarted.stats()["pin_budgets"] == {"e0": 150}
    # A count given again does not replace a budget set on purpose.
    restarted.set_engine_capacity("e0", 100)
    turn(restarted, "c", "r3", 300)
    assert restarted.stats()["pin_budgets"] == {"e0": 50}


async def test_background_flush_and_periodic_ticks():
    store = FakeMemoryStore()
    replicas = FakeDecodeReplicas({"d0": {"r1", "r2"}})
    memory = DecodeMemory(cfg_for_memory(release_interval_s=0.05), replicas, store, Counter())
    store.outbox = [FakeRelease("e0", "r1", "d0", 5, "unused")]
    memory.release_soon()
    await asyncio.sleep(0.01)
    assert replicas.calls == [("d0", ["r1"])]
    # A handle that expires later, with no turn to flush it: the ticker does.
    store.outbox = [FakeRelease("e0", "r2", "d0", 5, "expired")]
    await asyncio.sleep(0.12)
    assert replicas.calls[-1] == ("d0", ["r2"])
    memory._ticker.cancel()


async def test_store_without_hooks_is_left_alone():
    class OldStore:
        pass

    memory = DecodeMemory(cfg_for_memory(), FakeDecodeReplicas({}), OldStore(), Counter())
    assert not memory.enabled
    assert await memory.flush() == 0
    memory.release_soon()  # no task, no error


def cfg_for_memory(**sessions) -> AppConfig:
    return AppConfig.model_validate({"model": tempfile.mkdtemp(), "sessions": sessions})


# -- the store's side (connector.store) -----------------------------------------------------


def stored_store(clock):
    settings = StoreSettings(
        handle_ttl_s=25,
        decoder_ttl_s=30,
        max_sessions=100,
        max_blocks_per_engine=1_000_000,
        index_block_size=32,
    )
    return settings.handle_store(clock=clock)


def conv_on(session: str, blocks: int, engine="e0", replica="d0", request=None) -> Conversation:
    handle = KVHandle(
        Location.DECODE, engine, request or f"req-{session}", (tuple(range(blocks)),), "h", 1, blocks * 32
    )
    return Conversation(
        session, tuple(range(blocks * 32)), blocks * 32 - 8, handle=handle, decode_replica=replica
    )


def test_store_budget_from_engine_capacity_and_releases():
    now = [100.0]
    store = stored_store(lambda: now[0])
    for i in range(4):
        store.put(conv_on(f"s{i}", 10))
    assert store.take_releases() == []
    store.set_engine_capacity("e0", 50)  # budget 25 blocks: the two oldest handles go
    released = store.take_releases()
    assert [(r.request_id, r.decode_replica, r.num_blocks, r.reason) for r in released] == [
        ("req-s0", "d0", 10, "evicted"),
        ("req-s1", "d0", 10, "evicted"),
    ]
    # Taken releases no longer count as pinned: only the two waiting handles do.
    assert store.pinned_blocks("e0") == 20
    # A superseded handle is released too.
    store.put(conv_on("s3", 12, request="req-s3-b"))
    assert [(r.request_id, r.reason) for r in store.take_releases()] == [("req-s3", "superseded")]


def test_store_end_session_and_pin_remaining():
    now = [100.0]
    store = stored_store(lambda: now[0])
    store.put(conv_on("a", 4))
    now[0] += 12
    claim = store.begin_turn("a")
    assert claim.handle is not None and claim.pin_remaining_s == pytest.approx(18.0)
    store.end_turn(claim.lease_id, TurnOutcome.UNUSED, None)
    assert [(r.request_id, r.reason) for r in store.take_releases()] == [("req-a", "unused")]
    store.put(conv_on("b", 3))
    assert store.end_session("b") is True
    assert store.end_session("b") is False
    assert [(r.request_id, r.reason) for r in store.take_releases()] == [("req-b", "ended")]
    assert store.begin_turn("b").miss_reason == "no_conversation"


async def test_the_ticker_outlives_a_failing_tick_and_a_hung_replica(monkeypatch):
    """Nothing but the ticker frees expired pins early and syncs budgets while no turn
    comes: a tick that raises, or a replica call that never answers, must not end it."""
    from app.fleet import memory as memory_module

    monkeypatch.setattr(memory_module, "CAPACITY_SYNC_S", 0.05)
    monkeypatch.setattr(memory_module, "REPLICA_CALL_TIMEOUT_S", 0.05)
    replicas = FakeDecodeReplicas({"d0": set(), "d1": set()})
    hung = asyncio.Event()

    async def kv_blocks(replica_id):
        if replica_id == "d1" and not hung.is_set():
            await asyncio.Event().wait()  # the first call to d1 never answers
        return {"engine_id": f"engine-{replica_id}", "total": 300}

    replicas.decode_kv_blocks = kv_blocks
    store = CapacityStore()
    failures = iter([RuntimeError("store gone")])

    async def take_releases():
        for exc in failures:
            raise exc
        return []

    store.take_releases = take_releases
    counts: Counter = Counter()
    memory = DecodeMemory(cfg_for_memory(release_interval_s=0.02), replicas, store, counts)
    memory._start_ticker()
    await asyncio.sleep(0.3)
    assert store.capacity == {"engine-d0": 300}  # d1 hung, the ticker went on
    hung.set()
    await asyncio.sleep(0.3)
    assert store.capacity == {"engine-d0": 300, "engine-d1": 300}
    assert not memory._ticker.done() and counts["release_store_error"] == 1
    memory._ticker.cancel()
