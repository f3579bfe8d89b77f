"""Early release of decode-pinned KV (`connector.release`) and the ingress side that drives
it (`app.memory.DecodeMemory`). No engines: the worker-side expiry is checked against
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
from app.memory import DecodeMemory
from connector import release
from connector.handle import KVHandle, Location
from connector.store import Conversation, TurnOutcome


# -- worker side ------------------------------------------------------------------------


def test_installed_vllm_has_what_release_needs():
    release.check_support()  # raises Unsupported naming what is missing


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
    worker.xfer_stats.record_kv_expired_req = lambda: setattr(worker.xfer_stats, "expired", worker.xfer_stats.expired + 1)
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
        self.capacity: dict[str, int] = {}

    async def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        self.capacity[engine_id] = total_blocks

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
        return {"engine_id": f"engine-{replica_id}", "total": 300, "free": 250, "pinned": 10, "pinned_requests": 1}

    async def release(self, replica_id: str, request_ids) -> list[str]:
        self.calls.append((replica_id, list(request_ids)))
        held = self.pinned.get(replica_id, set())
        done = [r for r in request_ids if r in held]
        held.difference_update(done)
        return done

    def decode_alive(self, replica_id: str) -> bool | None:
        return replica_id not in self.dead


def conversation(replica: str, engine: str) -> Conversation:
    handle = KVHandle(Location.DECODE, engine, "req", ((1, 2),), "127.0.0.1", 5600, 40)
    return Conversation("s", (1, 2, 3), 2, handle=handle, decode_replica=replica)


async def test_releases_go_to_their_replicas_grouped():
    store = FakeMemoryStore()
    replicas = FakeDecodeReplicas({"d0": {"r1", "r2"}, "d1": {"r3"}}, dead={"d2"})
    counts: Counter = Counter()
    memory = DecodeMemory(cfg_for_memory(), replicas, store, counts)
    store.outbox = [
        FakeRelease("e0", "r1", "d0", 5, "evicted"),
        FakeRelease("e0", "r2", "d0", 7, "superseded"),
        FakeRelease("e1", "r3", "d1", 3, "session_ended"),
        FakeRelease("e1", "gone", "d1", 2, "expired"),
        FakeRelease("e2", "r4", "d2", 9, "evicted"),
    ]
    assert await memory.flush() == 3
    assert sorted(replicas.calls) == [("d0", ["r1", "r2"]), ("d1", ["r3", "gone"])]
    assert counts["released_requests"] == 3 and counts["released_blocks"] == 15
    assert counts["release_not_pinned"] == 1 and counts["release_replica_gone"] == 1
    assert counts["release_evicted"] == 2 and counts["release_session_ended"] == 1
    assert await memory.flush() == 0 and len(replicas.calls) == 2


async def test_capacity_learned_once_per_engine():
    store = FakeMemoryStore()
    replicas = FakeDecodeReplicas({})
    memory = DecodeMemory(cfg_for_memory(), replicas, store, Counter())
    await memory.learn_capacity(conversation("d0", "engine-d0"))
    await memory.learn_capacity(conversation("d0", "engine-d0"))
    assert store.capacity == {"engine-d0": 300} and replicas.block_queries == 1
    # A replica that now runs another engine than the handle's: nothing learned.
    counts = memory.counts
    await memory.learn_capacity(conversation("d1", "engine-old"))
    assert "engine-old" not in store.capacity and counts["capacity_unknown"] == 1


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
    from connector.store import HandleStore

    return HandleStore(
        handle_ttl_s=25, decoder_ttl_s=30, max_sessions=100, max_blocks_per_engine=1_000_000, clock=clock, pinned_fraction=0.5
    )


def conv_on(session: str, blocks: int, engine="e0", replica="d0", request=None) -> Conversation:
    handle = KVHandle(Location.DECODE, engine, request or f"req-{session}", (tuple(range(blocks)),), "h", 1, blocks * 32)
    return Conversation(session, tuple(range(blocks * 32)), blocks * 32 - 8, handle=handle, decode_replica=replica)


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
