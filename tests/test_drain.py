"""`app.fleet.drain.Drain`: a stopping decode replica's moves, over the real `HandleStore` and a
fake peer (the NIXL read itself is proven end to end in tests/e2e/test_scaling.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from app.engines.wire import EngineChunk, EngineRequest
from app.fleet.drain import Drain, Rebalance, rebalance_pairs
from connector.handle import KVHandle, Location
from connector.settings import StoreSettings
from connector.store import Claim, Conversation, HandleStore
from connector.store_api import MoveStore
from tests.test_turns import make_cfg, model_dir  # noqa: F401  # fixture

BLOCK = 4


class AsyncStore(MoveStore):
    """`MoveStore` over an in-process `HandleStore`."""

    def __init__(self, inner: HandleStore):
        self.inner = inner

    async def moving_out(self, engine_id: str) -> list[str]:
        return [s for _, s in self.inner.moving_out(engine_id)]

    async def begin_move(self, session_id: str, engine_id: str) -> Claim | None:
        return self.inner.begin_move(session_id, engine_id)

    async def end_move(self, claim: Claim, handle: KVHandle | None, decode_replica: str | None) -> str:
        return self.inner.end_move(claim.lease_id, handle, decode_replica)

    async def drop_engine(self, engine_id: str) -> int:
        return self.inner.drop_engine(engine_id)

    async def stats(self) -> dict:
        return {"shards": [self.inner.stats()]}


class Peer:
    """A surviving decode replica: reads what it is asked to (`pulled` of the tokens, all
    by default) and pins its copy under a new handle."""

    def __init__(self, *, delay_s: float = 0.0, fail: set[str] = frozenset(), short: bool = False):
        self.requests: list[EngineRequest] = []
        self.delay_s = delay_s
        self.fail = fail
        self.short = short
        self.in_flight = self.most_in_flight = 0

    async def __call__(self, request: EngineRequest) -> tuple[EngineChunk | None, str | None]:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if request.kv_params["remote_request_id"] in self.fail:
            raise RuntimeError("peer failed")
        n = len(request.prompt_token_ids)
        final = EngineChunk(
            token_ids=(7,),
            text="x",
            finished=True,
            finish_reason="length",
            num_prompt_tokens=n,
            num_cached_tokens=0 if self.short else n - 1,
            kv_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": "d-1",
                "remote_request_id": request.request_id,
                "remote_block_ids": [list(range(-(-n // BLOCK)))],
                "remote_host": "10.0.0.3",
                "remote_port": 5602,
                "remote_num_tokens": n,
            },
        )
        return final, "decode#1"


def store_with(sessions: int, engine: str = "d-0") -> HandleStore:
    store = StoreSettings(
        handle_ttl_s=100,
        decoder_ttl_s=150,
        max_sessions=100,
        max_blocks_per_engine=1000,
        index_block_size=BLOCK,
    ).handle_store()
    for i in range(sessions):
        ids = tuple(range(100 * i, 100 * i + 13))
        handle = KVHandle(
            Location.DECODE, engine, f"req-{i}", (tuple(range(4)),), "10.0.0.2", 5601, 12, cache_salt="salt"
        )
        store.put(Conversation(f"s{i}", ids, 10, None, handle, "decode#0"))
    return store


def drain_of(model_dir, store, peer, **drain) -> Drain:  # noqa: F811
    cfg = make_cfg(model_dir, block_size=BLOCK, drain=drain)
    return Drain(cfg, "d-0", "decode#0", AsyncStore(store), peer)


async def test_every_conversation_moves_to_a_peer_most_recent_first(model_dir):  # noqa: F811
    store, peer = store_with(6), Peer()
    counts = await drain_of(model_dir, store, peer, parallel=1).run()
    assert counts["sessions"] == 6 and counts["moved"] == 6
    assert counts["moved_blocks"] == 6 * 3  # 12 tokens, 4 a block
    assert counts["dropped"] == 0 and counts["recomputed"] == 0
    # Most recently stored first; each request reads the old blocks as from prefill.
    assert [r.kv_params["remote_request_id"] for r in peer.requests] == [f"req-{i}" for i in range(5, -1, -1)]
    first = peer.requests[0]
    assert first.kv_params["do_remote_prefill"] is True and first.kv_params["remote_engine_id"] == "d-0"
    assert first.prompt_token_ids == tuple(range(500, 512))  # the 12 positions the blocks hold
    assert first.sampling.max_tokens == 1 and first.avoid_replicas == ("decode#0",)
    assert first.cache_salt == "salt"
    for i in range(6):
        claim = store.begin_turn(f"s{i}")
        assert claim.handle is not None and claim.handle.engine_id == "d-1"
        assert claim.handle.location is Location.DECODE and claim.handle.cache_salt == "salt"
        assert claim.conversation.decode_replica == "decode#1"
        assert claim.conversation.token_ids == tuple(range(100 * i, 100 * i + 13))
    assert store.stats()["pinned_blocks"].get("d-0", 0) == 0


async def test_moves_run_in_parallel_within_the_budget_and_the_rest_is_dropped(model_dir):  # noqa: F811
    store, peer = store_with(10), Peer(delay_s=0.1)
    counts = await drain_of(model_dir, store, peer, parallel=2, budget_s=0.25).run()
    assert peer.most_in_flight == 2
    assert 2 <= counts["moved"] <= 6
    assert counts["moved"] + counts["out_of_time"] + counts["failed"] == 10
    # Moves cut by the deadline failed (their old blocks go with the engine); the ones
    # never started are dropped from the store with the engine.
    assert counts["dropped"] == counts["out_of_time"] > 0
    assert store.counts["dropped"] == counts["dropped"]
    assert store.stats()["open_leases"] == 0


async def test_a_failed_or_recomputed_move_is_counted(model_dir):  # noqa: F811
    store, peer = store_with(3), Peer(fail={"req-1"})
    counts = await drain_of(model_dir, store, peer).run()
    assert counts["moved"] == 2 and counts["failed"] == 1 and counts["dropped"] == 0
    assert store.begin_turn("s1").miss_reason == "failed"
    store, peer = store_with(1), Peer(short=True)
    counts = await drain_of(model_dir, store, peer).run()
    assert counts["moved"] == 1 and counts["recomputed"] == 1


async def test_a_drain_with_nothing_to_move_returns_at_once(model_dir):  # noqa: F811
    store, peer = store_with(2, engine="d-5"), Peer()
    counts = await drain_of(model_dir, store, peer).run()
    assert counts["sessions"] == 0 and not peer.requests and counts["dropped"] == 0


def test_rebalance_pairs_the_fullest_engines_with_the_emptiest_peers():
    budgets = {"a": 100, "b": 100, "c": 200, "d": 100}
    pinned = {"a": 95, "b": 10, "c": 190, "d": 50}
    # c (95%) and a (95%) are full; b (10%) and d (50%) have room under 60%.
    assert rebalance_pairs(pinned, budgets, ["a", "b", "c", "d"], 0.9, 0.6) == [("a", "b"), ("c", "d")]
    assert rebalance_pairs(pinned, budgets, ["a", "c"], 0.9, 0.6) == []  # no peer with room
    assert rebalance_pairs(pinned, budgets, ["a", "b", "x"], 0.9, 0.6) == [("a", "b")]  # x: no budget
    assert rebalance_pairs({"a": 80, "b": 0}, budgets, ["a", "b"], 0.9, 0.6) == []  # a not full


async def test_a_full_engine_moves_its_oldest_conversations_to_the_peer_with_room(model_dir):  # noqa: F811
    store = store_with(8)  # 8 conversations of 4 blocks on d-0, s0 the oldest
    store.set_engine_capacity("d-0", 70)  # budget 35 blocks (pinned_fraction 0.5): 32 is 91%
    store.set_engine_capacity("d-1", 70)
    assert store.pinned_blocks("d-0") == 32
    peer = Peer()
    cfg = make_cfg(model_dir, block_size=BLOCK)
    counts: Counter[str] = Counter()
    replica_of = {"d-0": "decode#0", "d-1": "decode#1"}
    moved = await Rebalance(cfg, AsyncStore(store), peer).round(replica_of, counts)
    # Down to the middle of the marks (75% of 35 blocks: 5.75 to move), oldest first; the
    # peer's copies hold 3 blocks each (12 tokens), so two moves.
    assert moved == counts["moved"] == 2 and counts["moved_blocks"] == 6
    assert [r.kv_params["remote_request_id"] for r in peer.requests] == ["req-0", "req-1"]
    assert all(r.preferred_replica == "decode#1" for r in peer.requests)
    assert store.pinned_blocks("d-0") == 24 and store.pinned_blocks("d-1") == 6
    assert store.begin_turn("s0").handle.engine_id == "d-1"
    # Under the mark now: the next round moves nothing.
    assert await Rebalance(cfg, AsyncStore(store), peer).round(replica_of, counts) == 0


@pytest.fixture(autouse=True)
def _no_ray_logs(caplog):
    caplog.set_level("WARNING", logger="ray.serve")
