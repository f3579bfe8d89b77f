"""Decode memory: the ingress's part in keeping a real budget of pinned KV on decode engines.

With bi-directional reuse every conversation's last turn stays pinned on its decode engine
until the next turn's prefill pulls it. The handle store decides which pins are worth
keeping (LRU, within `sessions.pinned_fraction` of each engine's blocks); this module
connects its decisions to the engines:

* capacity: the first time a turn leaves a handle on a decode engine this ingress does not
  know, its replica is asked for its block count (`DecodeServer.kv_blocks`, read from the
  engine's own block pool). Every turn stored then carries its engine's block count, so
  a store shard that restarted (empty) learns the budget again from the next turn on each
  engine, with no call of its own. Every `CAPACITY_SYNC_S` the ticker also asks the live
  decode replicas it has not met (a replacement that has served no turn yet) and tells
  the store every live engine's count: a restarted store has every budget back within
  that time even for engines no turn touched.
* releases: every handle the store lets go unread (evicted, superseded, expired, dropped,
  unused or failed, session ended) lands in its releases outbox; `flush` takes them
  (`take_releases`) and asks each decode replica to free those blocks now
  (`DecodeServer.release`), instead of at the engine's `decoder_kv_blocks_ttl`.

Flushes run after every turn's store update (in the background, off the answer's path),
after a session is ended, and every `sessions.release_interval_s` (handles that expire
while no turn comes). Engine and store calls that fail are counted, never raised: a
missed release only leaves blocks pinned until the engine's own TTL.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest
from app.fleet.drain import MoveCount, Rebalance, last_of
from app.turn.events import TurnCount
from connector import store_api
from connector.records import Conversation

logger = logging.getLogger("ray.serve").getChild(__name__)


class DecodeMemoryClients(Protocol):
    """How decode replicas are reached (Serve handles in production)."""

    async def decode_kv_blocks(self, replica_id: str) -> dict | None:
        """`DecodeServer.kv_blocks` of that replica: engine_id, total, free, pinned, ..."""
        ...

    async def release(self, replica_id: str, request_ids: Sequence[str]) -> list[str]: ...

    def decode_alive(self, replica_id: str) -> bool | None: ...

    def decode_replicas(self) -> frozenset[str] | None:
        """Running decode replicas as the router last saw them (None: not known yet)."""
        ...


CAPACITY_SYNC_S = 10.0
"""How often an ingress replica tells the store the block count of every live decode engine."""
REPLICA_CALL_TIMEOUT_S = 10.0
"""Deadline of one call to a decode replica from the background work here (a replica that
died mid-call must not stall the releases and syncs behind it)."""


MemoryStore = store_api.MemoryStore
"""The store's decode-memory hooks (`connector.store_api.MemoryStore`)."""


class DecodeMemory:
    """One per ingress replica. `counts` is shared with the turn counters."""

    def __init__(
        self, cfg: AppConfig, clients: DecodeMemoryClients, store: MemoryStore | None, counts: Counter
    ):
        self._cfg = cfg
        self._clients = clients
        self._store = store
        self.counts = counts
        self._blocks: dict[str, int] = {}
        """Block count of each decode engine this ingress learned (engine id -> blocks)."""
        self._engine_of: dict[str, str] = {}
        """Decode replica -> the engine it runs (learned with its block count)."""
        self._tasks: set[asyncio.Task] = set()
        self._flush_lock: asyncio.Lock | None = None
        self._ticker: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        """Bidir mode, with a store that has the decode-memory hooks."""
        return self._cfg.reuses_kv and hasattr(self._store, "take_releases")

    async def capacity_of(self, conversation: Conversation | None) -> int | None:
        """Before a new turn is stored: the block count of the engine its handle pins
        blocks on, asked of its replica the first time (one call per engine and ingress
        replica). None when there is nothing to pin or the engine cannot tell."""
        if not self.enabled or conversation is None or conversation.handle is None:
            return None
        engine_id = conversation.handle.engine_id
        known = self._blocks.get(engine_id)
        if known is not None or conversation.decode_replica is None:
            return known
        if not hasattr(self._clients, "decode_kv_blocks"):
            return None
        if await self._learn(conversation.decode_replica) != engine_id:
            self.counts[TurnCount.CAPACITY_UNKNOWN] += 1
            return None
        return self._blocks[engine_id]

    async def _learn(self, replica: str) -> str | None:
        """Ask a decode replica for its engine and block count and keep both. Returns the
        engine id, or None (no answer, or an answer from another replica)."""
        if not hasattr(self._clients, "decode_kv_blocks"):
            return None
        try:
            blocks = await asyncio.wait_for(self._clients.decode_kv_blocks(replica), REPLICA_CALL_TIMEOUT_S)
        except Exception as exc:
            logger.warning("could not read the KV blocks of decode replica %s: %r", replica, exc)
            return None
        if not blocks or blocks.get("replica_id", replica) != replica or not blocks.get("engine_id"):
            logger.info(
                "decode replica %s did not answer for itself: %s", replica, (blocks or {}).get("replica_id")
            )
            return None
        engine_id, total = blocks["engine_id"], int(blocks["total"])
        self._engine_of[replica] = engine_id
        self._blocks[engine_id] = total
        logger.info("decode replica %s runs engine %s (%d KV blocks)", replica, engine_id, total)
        return engine_id

    async def sync_capacities(self) -> int:
        """Learn the block count of live decode replicas not met yet, and tell the store
        the count of every live engine (idempotent). Returns the engines told."""
        replicas = getattr(self._clients, "decode_replicas", lambda: None)()
        if not self.enabled or self._store is None or replicas is None:
            return 0
        for gone in set(self._engine_of) - set(replicas):
            self._blocks.pop(self._engine_of.pop(gone), None)
        for replica in sorted(set(replicas) - set(self._engine_of)):
            await self._learn(replica)
        told = 0
        for engine_id in {self._engine_of[r] for r in replicas if r in self._engine_of}:
            try:
                await self._store.set_engine_capacity(engine_id, self._blocks[engine_id])
                told += 1
                self.counts[TurnCount.CAPACITY_SYNCED] += 1
            except Exception as exc:
                logger.warning("could not tell the store the capacity of %s: %r", engine_id, exc)
                self.counts[TurnCount.CAPACITY_SYNC_ERROR] += 1
        return told

    async def rebalance(self) -> int:
        """One round of `app.fleet.drain.Rebalance` over the live decode engines this ingress
        knows (`drain.rebalance`). Returns the conversations moved; never raises."""
        d = self._cfg.drain
        replicas = getattr(self._clients, "decode_replicas", lambda: None)()
        if not (self.enabled and d.rebalance and replicas and hasattr(self._store, "moving_out")):
            return 0
        if set(replicas) - set(self._engine_of):
            await self.sync_capacities()  # a new replica (scale-up) takes moves at once
        replica_of = {self._engine_of[r]: r for r in replicas if r in self._engine_of}
        moved: Counter[MoveCount] = Counter()
        try:
            return await Rebalance(self._cfg, self._store, self._move).round(replica_of, moved)
        except Exception:
            logger.exception("a rebalancing round failed")
            self.counts[TurnCount.REBALANCE_ERROR] += 1
            return 0
        finally:
            for key, n in moved.items():
                self.counts[TurnCount(f"rebalance_{key}")] += n

    async def _move(self, request: EngineRequest) -> tuple[EngineChunk | None, str | None]:
        return await last_of(self._clients.decode(request))  # type: ignore[attr-defined]

    def release_soon(self) -> None:
        """Flush the store's releases in the background (after a store update)."""
        if not self.enabled:
            return
        self._start_ticker()
        # Shared work in a context of its own: not a child of the request that started it,
        # which Ray would cancel with that request (`app.api.serving.outliving`).
        task = asyncio.get_running_loop().create_task(self.flush(), context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> int:
        """Take the store's releases and send them to their decode replicas, grouped.
        Returns how many pinned requests the engines released."""
        if not self.enabled or self._store is None:
            return 0
        if self._flush_lock is None:
            self._flush_lock = asyncio.Lock()
        async with self._flush_lock:
            try:
                releases = await self._store.take_releases()
            except Exception:
                logger.exception("could not take the store's releases")
                self.counts[TurnCount.RELEASE_STORE_ERROR] += 1
                return 0
            by_replica: dict[str, list[Any]] = defaultdict(list)
            for r in releases:
                self.counts[TurnCount.release(r.reason)] += 1
                if r.decode_replica is None or self._clients.decode_alive(r.decode_replica) is False:
                    self.counts[TurnCount.RELEASE_REPLICA_GONE] += 1
                    continue
                by_replica[r.decode_replica].append(r)
            released = 0
            for replica, batch in by_replica.items():
                try:
                    call = self._clients.release(replica, [r.request_id for r in batch])
                    done = set(await asyncio.wait_for(call, REPLICA_CALL_TIMEOUT_S))
                except Exception:
                    logger.exception("release on decode replica %s failed", replica)
                    self.counts[TurnCount.RELEASE_ENGINE_ERROR] += len(batch)
                    continue
                released += len(done)
                self.counts[TurnCount.RELEASED_REQUESTS] += len(done)
                self.counts[TurnCount.RELEASED_BLOCKS] += sum(
                    r.num_blocks for r in batch if r.request_id in done
                )
                self.counts[TurnCount.RELEASE_NOT_PINNED] += len(batch) - len(done)
            return released

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), context=contextvars.Context())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        synced = loop.time()
        while True:
            await asyncio.sleep(self._cfg.sessions.release_interval_s)
            try:
                await self.flush()
                if loop.time() - synced >= CAPACITY_SYNC_S:
                    synced = loop.time()
                    await self.sync_capacities()
                await self.rebalance()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this ticker was cancelled
                logger.warning("a decode-memory tick was cut short by a cancelled call")
            except Exception:
                # A tick that fails must not end the ticker: nothing else frees expired
                # pins early or syncs budgets while no turn comes.
                logger.exception("decode-memory tick failed")
                self.counts[TurnCount.MEMORY_TICK_ERROR] += 1
