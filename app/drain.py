"""A stopping decode replica hands the conversations it pins to its peers.

Serve stops a decode replica for a downscale, a redeploy with fewer replicas, or a node
drain: it stops routing to it, lets its in-flight answers finish, then calls its
destructor (`DecodeServer.__del__`), which runs `Drain.run` before the engine shuts down.
For each conversation whose handle pins blocks on this engine, most recently stored
first, within `drain.budget_s`:

    claim     the store's `begin_move`: the handle is claimed, so no turn can read it
              meanwhile (a turn that arrives finds it `moving` and waits, `drain.wait_s`)
    read      a peer decode replica (Serve's router picks one; this one no longer gets
              requests) runs a one-token request over the conversation's tokens with
              `move_params`: it reads the blocks over NIXL, as from a prefill engine, and
              pins its own copy under a new handle, as after any turn
    swap      the store's `end_move`: the record now names the new handle and replica
              (or, if a turn stored a newer conversation meanwhile, the copy is released)

What is not moved (past the budget, or the peer failed) is dropped from the store with
the engine (`drop_engine`), and counted. Moves go `drain.parallel` at a time; the peer's
pinned budget is the store's as for any turn (it may evict its least recently used).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from app.config import AppConfig
from app.wire import EngineChunk, EngineRequest, Sampling
from connector.handle import KVHandle, Location, WireError, move_params
from connector.records import Claim

logger = logging.getLogger("ray.serve")


class MoveStore(Protocol):
    """The handle store's side of a drain (`connector.actor.StoreClient`)."""

    async def moving_out(self, engine_id: str) -> list[str]: ...

    async def begin_move(self, session_id: str, engine_id: str) -> Claim | None: ...

    async def end_move(self, claim: Claim, handle: KVHandle | None, decode_replica: str | None) -> str: ...

    async def drop_engine(self, engine_id: str) -> int: ...


Mover = Callable[[EngineRequest], Awaitable[tuple[EngineChunk | None, str | None]]]
"""Runs a move request on a peer decode replica: its final chunk and the peer's replica id."""


class Drain:
    """Moves one stopping decode replica's conversations (`run`, once)."""

    def __init__(self, cfg: AppConfig, engine_id: str, replica_id: str, store: MoveStore, move: Mover):
        self._cfg = cfg
        self._engine_id = engine_id
        self._replica_id = replica_id
        self._store = store
        self._move = move
        self.counts: Counter[str] = Counter()
        """`sessions`, `moved`, `moved_blocks`, `pulled_tokens`, `recomputed` (the peer
        computed instead of reading), `superseded`, `failed`, `late`, `store_error`,
        `out_of_time`, `dropped`."""

    async def run(self) -> Counter[str]:
        started = time.monotonic()
        deadline = started + self._cfg.drain.budget_s
        sessions = await self._store.moving_out(self._engine_id)
        self.counts["sessions"] = len(sessions)
        queue = list(reversed(sessions))  # popped from the end: most recent first
        await asyncio.gather(*(self._worker(queue, deadline) for _ in range(self._cfg.drain.parallel)))
        self.counts["out_of_time"] += len(queue)
        # Whatever is still stored here goes with the engine: forget it now, so no turn
        # tries to pull it once the replica is gone.
        self.counts["dropped"] = await self._store.drop_engine(self._engine_id)
        elapsed = time.monotonic() - started
        logger.info("decode replica %s drained in %.2f s: %s", self._replica_id, elapsed, dict(self.counts))
        return self.counts

    async def _worker(self, queue: list[str], deadline: float) -> None:
        while queue and time.monotonic() < deadline:
            session_id = queue.pop()
            try:
                await self._one(session_id, deadline)
            except Exception as exc:  # the store failed: the session stays to be dropped
                self.counts["store_error"] += 1
                logger.warning("moving session %s off %s: store error %r", session_id, self._replica_id, exc)

    async def _one(self, session_id: str, deadline: float) -> None:
        claim = await self._store.begin_move(session_id, self._engine_id)
        if claim is None:  # a turn claimed it meanwhile, or it left the store
            return
        handle, conv = claim.handle, claim.conversation
        assert handle is not None and conv is not None  # a move claims a stored handle
        new, replica = None, None
        try:
            read = self._read(handle, conv.token_ids)
            new, replica = await asyncio.wait_for(read, deadline - time.monotonic())
        except Exception as exc:  # a timeout included: the old blocks go with the engine
            logger.warning("moving session %s off %s failed: %r", session_id, self._replica_id, exc)
        result = await self._store.end_move(claim, new, replica)
        self.counts[result] += 1
        if result == "moved" and new is not None:
            self.counts["moved_blocks"] += new.num_blocks

    async def _read(self, handle: KVHandle, token_ids: Sequence[int]) -> tuple[KVHandle | None, str | None]:
        """A peer reads the blocks and pins its own copy; its new handle (None if the
        engine gave none) and replica."""
        request = EngineRequest(
            request_id=f"move-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(token_ids[: handle.num_tokens]),
            sampling=Sampling(max_tokens=1, temperature=0.0),
            kv_params=move_params(handle),
            avoid_replicas=(self._replica_id,),
            cache_salt=handle.cache_salt,
        )
        final, replica = await self._move(request)
        if final is None:
            return None, None
        pulled = final.num_cached_tokens
        self.counts["pulled_tokens"] += pulled
        if pulled + self._cfg.block_size <= handle.num_tokens:
            self.counts["recomputed"] += 1  # the peer computed what it could not read
        try:
            new = KVHandle.from_wire(final.kv_params)
        except WireError:
            return None, replica
        if new.location is not Location.DECODE:
            return None, replica
        return dataclasses.replace(new, cache_salt=handle.cache_salt), replica
