"""The per-turn operations bound for one shard, sent in batches.

One `ShardQueue` per shard in each ingress replica's `connector.client.StoreClient`, on
that replica's event loop. It sends the `Route.BATCHED` operations (`StoreOp`) of every
request in the replica to its shard's `apply` as packed batches (`connector.shard.pack`),
and answers each caller's future with its own result or error. It owns nothing on the
shard: a batch that fails fails each of its operations, and the shard's state is as the
operations that ran left it.
"""

from __future__ import annotations

import asyncio
import contextvars
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

from connector.shard import pack
from connector.store_api import StoreOp, StoreUnavailable

MAX_BATCH = 256


class ShardQueue:
    """Up to `MAX_IN_FLIGHT` batches are in flight at once (Ray runs one caller's calls to
    an actor in the order they were sent); what arrives while all are out leaves together
    in the next batch. A burst is split among the senders free to take it, so the shard
    works on one part while the answers to another are on their way back (one large batch
    would leave the shard idle while its callers prepare their next operations, then the
    callers idle while it works). A failed batch fails each of its operations with
    `StoreUnavailable`."""

    MAX_IN_FLIGHT = 4

    def __init__(self, actor, call: Callable[[Any], Awaitable[Any]]):
        self._actor = actor
        self._call = call
        self._pending: list[tuple[StoreOp, tuple, asyncio.Future]] = []
        self._senders: set[asyncio.Task] = set()
        self._free = 0
        """Senders started and not waiting for an answer: the ways a burst is split."""

    def submit(self, op: StoreOp, args: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((op, args, future))
        if len(self._senders) < self.MAX_IN_FLIGHT:
            self._free += 1
            # A context of its own: a batch carries many requests' operations, so it must
            # not count as a child of the request whose call started its sender (Ray cancels
            # a cancelled request's child tasks: a client hanging up would fail the others).
            task = loop.create_task(self._send(), context=contextvars.Context())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return future

    async def _send(self) -> None:
        try:
            while self._pending:
                take = min(MAX_BATCH, -(-len(self._pending) // max(1, self._free)))
                batch, self._pending = self._pending[:take], self._pending[take:]
                self._free -= 1
                try:
                    await self._send_batch(batch)
                finally:
                    self._free += 1
        finally:
            self._free -= 1

    async def _send_batch(self, batch: list[tuple[StoreOp, tuple, asyncio.Future]]) -> None:
        try:
            packed = pack([(op.value, args) for op, args, _ in batch])
            results = pickle.loads(await self._call(self._actor.apply.remote(packed)))
        except StoreUnavailable as exc:
            results = [(False, exc)] * len(batch)
        except Exception as exc:  # never leave a caller waiting
            unavailable = StoreUnavailable(f"store batch failed: {exc!r}")
            results = [(False, unavailable)] * len(batch)
        for (_, _, future), (ok, value) in zip(batch, results, strict=False):
            if future.done():  # its caller went away
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
