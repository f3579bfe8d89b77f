"""The client every ingress replica uses to reach the sharded handle store.

`StoreClient` implements `connector.store_api.StoreApi` in an ingress replica's process,
on its event loop; the shards it calls are Ray actors owned by the `SessionStore`
deployment (`connector.actor`), asked for once and again after a call failed. Every call
has a deadline; a failed or late call raises `StoreUnavailable`, and the turn goes on
without reuse. Each operation goes where its `StoreOp.route` says (`_run`): per-turn
operations to their session's shard in that shard's next batch (`connector.shard_queue`),
moves to their session's shard, stored responses to the shard their chain hashes to,
and the rest to every shard, whose answers the method combines. A sessionless prompt is
matched against every shard.

A turn travels both ways without its history where the other side has it: `begin_turn`
names the conversation this client stored last (not sent back if it is still the stored
one), and `end_turn` sends only what the turn added to the conversation it claimed
(`ConversationTail`). The client holds no shard state: blocks a shard lets go are freed
by whoever takes its releases (`take_releases`, `app.fleet.memory`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from connector.handle import KVHandle
from connector.records import Claim, Conversation, ConversationTail, Release, TurnOutcome
from connector.response_store import StoredResponse, route_of
from connector.settings import StoreSettings
from connector.shard import LocalActor, StoreShard
from connector.shard_queue import ShardQueue
from connector.store_api import STORE_CALL_TIMEOUT_S, Route, StoreOp, StoreUnavailable, shard_of

ShardSource = Callable[[], Awaitable[tuple[StoreSettings | None, list]]]


class StoreClient:
    """Ingress-side view of the sharded store (`StoreApi`). Every method raises
    `StoreUnavailable` when the store cannot answer within `timeout_s`."""

    RECENT = 1024
    """Conversations this client stored last (per session, LRU): a session's next turn
    that lands here again is not sent back by the store."""

    def __init__(
        self,
        source: ShardSource,
        expected: StoreSettings | None = None,
        timeout_s: float = STORE_CALL_TIMEOUT_S,
    ):
        self._source = source
        self._expected = expected
        self._timeout = timeout_s
        self._recent: OrderedDict[str, Conversation] = OrderedDict()
        self._actors: list | None = None
        self._queues: dict[int, ShardQueue] = {}
        self._lock = asyncio.Lock()

    @classmethod
    def of_deployment(cls, handle, expected: StoreSettings, **kwargs) -> StoreClient:
        """Shards owned by a `SessionStore` deployment (its `DeploymentHandle`)."""

        async def source():
            return await handle.shards.remote()

        return cls(source, expected, **kwargs)

    @classmethod
    def of_actors(cls, actors: list, **kwargs) -> StoreClient:
        async def source():
            return None, actors

        return cls(source, **kwargs)

    @classmethod
    def of_shards(cls, shards: Sequence[StoreShard], **kwargs) -> StoreClient:
        """Shards in this process (`StoreShard(settings)`), called as actors are: tests."""
        return cls.of_actors([LocalActor(s) for s in shards], **kwargs)

    async def _shards(self) -> list:
        if self._actors is not None:
            return self._actors
        async with self._lock:
            if self._actors is None:
                try:
                    settings, actors = await asyncio.wait_for(self._source(), self._timeout)
                except Exception as exc:
                    raise StoreUnavailable(f"the session store did not answer: {exc!r}") from exc
                if self._expected is not None and settings != self._expected:
                    # A redeploy in flight: the old store answered. Ask again next time.
                    raise StoreUnavailable(f"the running store has settings {settings}, not {self._expected}")
                self._actors = actors
                self._queues = {i: ShardQueue(a, self._call) for i, a in enumerate(actors)}
        return self._actors

    async def _call(self, ref) -> Any:
        try:
            return await asyncio.wait_for(ref, self._timeout)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            # The shard is restarting or its owner is gone: fetch the shards again next time.
            self._actors = None
            raise StoreUnavailable(f"store call failed: {exc!r}") from exc

    async def _run(self, op: StoreOp, *args: Any, key: str | None = None) -> Any:
        """Send `op` with `args` where its route says: `key` is the session id or response
        key the route needs. `Route.ALL`: every shard's answer, in shard order."""
        actors = await self._shards()
        if op.route is Route.ALL:
            return await asyncio.gather(*(self._call(a.call.remote(op.value, *args)) for a in actors))
        assert key is not None  # every other route needs one
        index = shard_of(route_of(key) if op.route is Route.RESPONSE else key, len(actors))
        if op.route is not Route.BATCHED:
            return await self._call(actors[index].call.remote(op.value, *args))
        queued = self._queues[index].submit(op, args)
        try:
            # Queued behind the batches in flight (each bound by a call deadline, and sent
            # in order), then sent itself: two deadlines at most.
            return await asyncio.wait_for(queued, 2 * self._timeout)
        except TimeoutError as exc:
            raise StoreUnavailable(f"store {op.value} got no answer in {2 * self._timeout:.0f} s") from exc

    async def _share(self, blocks: int | None) -> int | None:
        """A shard's part of an engine's blocks: each keeps its own pins on that engine
        within its part of the budget, so together they stay within it."""
        return max(1, blocks // len(await self._shards())) if blocks else None

    # -- turns -------------------------------------------------------------------------

    async def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None = None
    ) -> tuple[str | None, int]:
        results = await self._run(StoreOp.MATCH, list(prompt_ids), prompt_text)
        return max(results, key=lambda r: (r[0] is not None, r[1]))

    async def begin_turn(self, session_id: str) -> Claim:
        held = self._recent.get(session_id)
        known = held.handle.request_id if held is not None and held.handle is not None else None
        claim = await self._run(StoreOp.BEGIN_TURN, session_id, known, key=session_id)
        if claim.conversation_known:
            claim = dataclasses.replace(claim, conversation=held)
        return claim

    async def end_turn(
        self,
        claim: Claim,
        outcome: TurnOutcome,
        conversation: Conversation | None,
        engine_blocks: int | None = None,
        retain: bool = False,
    ) -> None:
        """Settle the claim and store the turn. `engine_blocks`: the block count of the
        engine the new turn's handle pins on, if known; the shard takes its part of it
        as that engine's budget when it has none (it restarted, or never heard of it).
        `retain`: the client asked for long retention (`HandleStore.put`)."""
        self._recent.pop(claim.session_id, None)
        # A turn that extends the conversation it claimed travels as its tail.
        sent: Conversation | ConversationTail | None = conversation
        if conversation is not None and claim.conversation is not None:
            sent = ConversationTail.of(conversation, claim.conversation) or conversation
        share = await self._share(engine_blocks)
        await self._run(StoreOp.END_TURN, claim.lease_id, outcome, sent, share, retain, key=claim.session_id)
        if conversation is not None and conversation.handle is not None:
            self._recent[claim.session_id] = conversation
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)

    async def end_session(self, session_id: str) -> bool:
        self._recent.pop(session_id, None)
        return await self._run(StoreOp.END_SESSION, session_id, key=session_id)

    # -- engines gone or draining ------------------------------------------------------

    async def drop_engine(self, engine_id: str) -> int:
        return sum(await self._run(StoreOp.DROP_ENGINE, engine_id))

    async def moving_out(self, engine_id: str) -> list[str]:
        """The sessions whose stored handle pins blocks on `engine_id`, every shard's,
        most recently stored first (shards on one node share the monotonic clock)."""
        shards = await self._run(StoreOp.MOVING_OUT, engine_id)
        return [session for _, session in sorted((e for shard in shards for e in shard), reverse=True)]

    async def begin_move(self, session_id: str, engine_id: str) -> Claim | None:
        return await self._run(StoreOp.BEGIN_MOVE, session_id, engine_id, key=session_id)

    async def end_move(self, claim: Claim, handle: KVHandle | None, decode_replica: str | None) -> str:
        return await self._run(StoreOp.END_MOVE, claim.lease_id, handle, decode_replica, key=claim.session_id)

    # -- decode memory -----------------------------------------------------------------

    async def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        """The engine's blocks are split evenly among the shards (`_share`)."""
        await self._run(StoreOp.SET_ENGINE_CAPACITY, engine_id, await self._share(total_blocks) or 1)

    async def take_releases(self) -> list[Release]:
        shards = await self._run(StoreOp.TAKE_RELEASES)
        return [r for shard in shards for r in shard]

    # -- stored responses (`connector.response_store`), on the shard their key hashes to ------

    async def put_response(self, resp: StoredResponse, history: list[dict] | None = None) -> str:
        """Store a response that keeps only what it added over `resp.parent_key`. If the
        shard no longer has the parent (evicted, or the shard restarted), it is stored
        again standing alone with `history` (the parent's whole conversation, as
        `continue_response` gave it). Returns `ResponseStore.put`'s answer."""
        result = await self._run(StoreOp.PUT_RESPONSE, resp, key=resp.key)
        if result == "no_parent" and history is not None:
            alone = dataclasses.replace(resp, messages=history + resp.messages, parent_key=None)
            result = await self._run(StoreOp.PUT_RESPONSE, alone, key=resp.key)
        return result

    async def get_response(self, key: str) -> StoredResponse | None:
        return await self._run(StoreOp.GET_RESPONSE, key, key=key)

    async def continue_response(self, key: str, request_id: str) -> tuple[StoredResponse | None, bool]:
        """The response and whether `request_id` owns its continuation (the first request
        to continue it does; another one forks: the caller runs it in a new session)."""
        return await self._run(StoreOp.CONTINUE_RESPONSE, key, request_id, key=key)

    async def release_continuation(self, key: str, request_id: str) -> None:
        """Give back a continuation `request_id` owns: it failed before storing its response."""
        await self._run(StoreOp.RELEASE_CONTINUATION, key, request_id, key=key)

    async def delete_response(self, key: str) -> StoredResponse | None:
        return await self._run(StoreOp.DELETE_RESPONSE, key, key=key)

    async def stats(self) -> dict:
        return {"shards": await self._run(StoreOp.STATS)}
