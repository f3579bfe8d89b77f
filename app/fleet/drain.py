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
import enum
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest, Sampling
from connector import store_api
from connector.handle import KVHandle, Location, WireError, move_params

logger = logging.getLogger("ray.serve").getChild(__name__)


MoveStore = store_api.MoveStore
"""The handle store's side of a drain (`connector.store_api.MoveStore`)."""


Mover = Callable[[EngineRequest], Awaitable[tuple[EngineChunk | None, str | None]]]
"""Runs a move request on a peer decode replica: its final chunk and the peer's replica id."""


async def last_of(stream: AsyncIterator[tuple[EngineChunk, str]]) -> tuple[EngineChunk | None, str | None]:
    """The final chunk of a decode replica's stream and that replica's id (a `Mover`'s
    answer), or (None, None) for an empty stream."""
    last, peer = None, None
    async for chunk, replica in stream:
        last, peer = chunk, replica
    return last, peer


class MoveCount(enum.StrEnum):
    """The counters of moves (`Moves.counts`, `Drain.counts`); a rebalance reports them as
    `rebalance_<count>` (`app.turn.events.TurnCount`)."""

    # The store's verdict on a move (`end_move`).
    MOVED = "moved"
    SUPERSEDED = "superseded"
    FAILED = "failed"
    LATE = "late"
    MOVED_BLOCKS = "moved_blocks"
    PULLED_TOKENS = "pulled_tokens"
    RECOMPUTED = "recomputed"  # the peer computed what it could not read
    STORE_ERROR = "store_error"
    # A drain's conversations: found, left past its budget, dropped with the engine.
    SESSIONS = "sessions"
    OUT_OF_TIME = "out_of_time"
    DROPPED = "dropped"


class Moves:
    """Moves conversations off one decode engine, one `move` call each, counted in `counts`."""

    def __init__(self, cfg: AppConfig, engine_id: str, replica_id: str, store: MoveStore, move: Mover):
        self._cfg = cfg
        self.engine_id = engine_id
        self.replica_id = replica_id
        self._store = store
        self._move = move
        self.counts: Counter[MoveCount] = Counter()

    async def one(self, session_id: str, deadline: float, to_replica: str | None = None) -> str | None:
        """Move one session's conversation, to `to_replica` if given (else Serve's router
        picks a peer). Returns the store's verdict, None if the session was not there to
        claim (a turn holds it, or it left)."""
        try:
            claim = await self._store.begin_move(session_id, self.engine_id)
        except Exception as exc:  # the session stays where it is
            self.counts[MoveCount.STORE_ERROR] += 1
            logger.warning("moving session %s off %s: store error %r", session_id, self.replica_id, exc)
            return None
        if claim is None:
            return None
        handle, conv = claim.handle, claim.conversation
        assert handle is not None and conv is not None  # a move claims a stored handle
        new, replica = None, None
        try:
            read = self._read(handle, conv.token_ids, to_replica)
            new, replica = await asyncio.wait_for(read, deadline - time.monotonic())
        except Exception as exc:  # a timeout included: the old blocks stay where they are
            logger.warning("moving session %s off %s failed: %r", session_id, self.replica_id, exc)
        try:
            result = await self._store.end_move(claim, new, replica)
        except Exception as exc:  # the lease expires; the peer's copy at its engine's TTL
            self.counts[MoveCount.STORE_ERROR] += 1
            logger.warning("moving session %s off %s: store error %r", session_id, self.replica_id, exc)
            return None
        self.counts[MoveCount(result)] += 1
        if result == MoveCount.MOVED and new is not None:
            self.counts[MoveCount.MOVED_BLOCKS] += new.num_blocks
        return result

    async def _read(
        self, handle: KVHandle, token_ids: Sequence[int], to_replica: str | None
    ) -> tuple[KVHandle | None, str | None]:
        """A peer reads the blocks and pins its own copy; its new handle (None if the
        engine gave none) and replica."""
        request = EngineRequest(
            request_id=f"move-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(token_ids[: handle.num_tokens]),
            sampling=Sampling(max_tokens=1, temperature=0.0),
            kv_params=move_params(handle),
            preferred_replica=to_replica,
            avoid_replicas=(self.replica_id,),
            cache_salt=handle.cache_salt,
        )
        final, replica = await self._move(request)
        if final is None:
            return None, None
        pulled = final.num_cached_tokens
        self.counts[MoveCount.PULLED_TOKENS] += pulled
        if pulled + self._cfg.block_size <= handle.num_tokens:
            self.counts[MoveCount.RECOMPUTED] += 1
        try:
            new = KVHandle.from_wire(final.kv_params)
        except WireError:
            return None, replica
        if new.location is not Location.DECODE:
            return None, replica
        return dataclasses.replace(new, cache_salt=handle.cache_salt), replica


class Drain:
    """Moves one stopping decode replica's conversations (`run`, once), counted in `counts`."""

    PASSES = 2
    """Times the store is asked for what is left: a turn that ended as the replica stopped
    may store its conversation here after the first list was taken."""

    def __init__(self, cfg: AppConfig, engine_id: str, replica_id: str, store: MoveStore, move: Mover):
        self._cfg = cfg
        self._store = store
        self._moves = Moves(cfg, engine_id, replica_id, store, move)
        self.counts = self._moves.counts

    async def run(self) -> Counter[MoveCount]:
        moves = self._moves
        started = time.monotonic()
        deadline = started + self._cfg.drain.budget_s
        queue: list[str] = []
        for _ in range(self.PASSES):
            sessions = await self._store.moving_out(moves.engine_id)
            if not sessions or time.monotonic() >= deadline:
                break
            self.counts[MoveCount.SESSIONS] += len(sessions)
            queue = list(reversed(sessions))  # popped from the end: most recent first
            workers = (self._worker(queue, deadline) for _ in range(self._cfg.drain.parallel))
            await asyncio.gather(*workers)
        self.counts[MoveCount.OUT_OF_TIME] += len(queue)
        # Whatever is still stored here goes with the engine: forget it now, so no turn
        # tries to pull it once the replica is gone.
        self.counts[MoveCount.DROPPED] = await self._store.drop_engine(moves.engine_id)
        elapsed = time.monotonic() - started
        logger.info("decode replica %s drained in %.2f s: %s", moves.replica_id, elapsed, dict(self.counts))
        return self.counts

    async def _worker(self, queue: list[str], deadline: float) -> None:
        while queue and time.monotonic() < deadline:
            await self._moves.one(queue.pop(), deadline)


def rebalance_pairs(
    pinned: Mapping[str, int], budgets: Mapping[str, int], engines: Iterable[str], above: float, below: float
) -> list[tuple[str, str]]:
    """(full engine, peer) pairs: each live engine whose pinned blocks are past `above` of
    its budget, with the live peer least full relative to its budget, if that one is under
    `below` of it. Fullest first; a peer takes from one engine per round."""
    fill = {e: pinned.get(e, 0) / budgets[e] for e in engines if budgets.get(e)}
    pairs: list[tuple[str, str]] = []
    taken: set[str] = set()
    for src in sorted((e for e in fill if fill[e] > above), key=lambda e: -fill[e]):
        peers = [e for e in fill if e != src and e not in taken and fill[e] < below]
        if peers:
            dst = min(peers, key=lambda e: fill[e])
            taken.add(dst)
            pairs.append((src, dst))
    return pairs


class Rebalance:
    """Moves the least recently used conversations of a decode engine whose pinned share
    is nearly full (`drain.rebalance_above` of its budget) to the peer with the most room
    (under `drain.rebalance_below`), instead of letting the store evict them once it is
    full. Run by each ingress's decode-memory ticker (`app.fleet.memory`); moves of the same
    session from two ingresses cannot collide (the store's claim is atomic)."""

    def __init__(self, cfg: AppConfig, store: Any, move: Mover):
        self._cfg = cfg
        self._store = store
        self._move = move

    async def round(self, replica_of: Mapping[str, str], counts: Counter[MoveCount]) -> int:
        """One round over the live engines (`replica_of`: engine id -> its replica).
        Returns the conversations moved; counts `moved`, `moved_blocks`, ... into `counts`."""
        d = self._cfg.drain
        if len(replica_of) < 2:
            return 0
        shards = (await self._store.stats())["shards"]
        pinned: Counter[str] = Counter()
        budgets: Counter[str] = Counter()
        for shard in shards:
            pinned.update(shard.get("pinned_blocks") or {})
            budgets.update(shard.get("pin_budgets") or {})
        moved = 0
        for src, dst in rebalance_pairs(pinned, budgets, replica_of, d.rebalance_above, d.rebalance_below):
            # Down to the middle of the two marks, as far as the peer stays under `below`.
            want = min(
                pinned[src] - (d.rebalance_above + d.rebalance_below) / 2 * budgets[src],
                d.rebalance_below * budgets[dst] - pinned[dst],
            )
            moves = Moves(self._cfg, src, replica_of[src], self._store, self._move)
            oldest = list(reversed(await self._store.moving_out(src)))
            deadline = time.monotonic() + d.budget_s
            for session_id in oldest:
                if moves.counts[MoveCount.MOVED_BLOCKS] >= want or time.monotonic() >= deadline:
                    break
                if await moves.one(session_id, deadline, to_replica=replica_of[dst]) == MoveCount.MOVED:
                    moved += 1
            logger.info("rebalanced decode engine %s to %s: %s", src, dst, dict(moves.counts))
            counts.update(moves.counts)
        return moved
