"""The handle store as Ray actors, the Serve deployment that owns them, and the client
every ingress replica uses.

Lifetime: `SessionStore` is a deployment of the application graph (bound by the builder
with the app's `StoreSettings`). Its one replica creates the shards (`HandleStoreActor`,
non-detached, so they die with it): a redeploy with other settings replaces the replica
and with it the shards, and `serve delete` removes them with the app. A shard that dies
is restarted by Ray (`max_restarts=-1`) empty: reuse is lost, never correctness.

Per-turn calls go from the ingress straight to the shards (`StoreClient`); the ingress
asks `SessionStore` for the shard handles once, and again after a call failed. Every
call has a deadline; a failed or late call raises `StoreUnavailable`, and the turn goes
on without reuse. Sessions are sharded by a stable hash of their id; a sessionless prompt
is matched against every shard. Each shard also keeps the stored Responses API objects
whose key hashes to it (`connector.response_store`), one call per operation.

Per-turn operations (begin turn, end turn, end session) are batched per shard: while a few
batches are in flight to a shard, the operations that arrive queue up and leave together
in the next one (`HandleStoreActor.apply`), in arrival order. A shard with room gets an
operation at once, so one turn costs one round trip; a busy one costs a round trip per
batch, not per operation, which is what lets one shard keep up with a fleet. A turn
travels both ways without its history where the other side has it: `begin_turn` names
the conversation this client stored last (not sent back if it is still the stored one),
and `end_turn` sends only what the turn added to the conversation it claimed
(`ConversationTail`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import pickle
import time
import zlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from connector.handle import KVHandle
from connector.records import DEFAULT_MAX_STORE_BYTES, Claim, Conversation, ConversationTail, TurnOutcome
from connector.response_store import ResponseStore, StoredResponse, route_of
from connector.store import HandleStore

logger = logging.getLogger("ray.serve")

STORE_CALL_TIMEOUT_S = 5.0
"""Deadline of one store call from the ingress; past it the turn goes on without reuse."""


class StoreUnavailable(Exception):
    """A store call failed or timed out (shard restarting or gone, store redeploying)."""


@dataclass(frozen=True)
class StoreSettings:
    """What a store is built with; the ingress checks the running store has exactly these."""

    handle_ttl_s: float
    decoder_ttl_s: float
    max_sessions: int
    max_blocks_per_engine: int
    index_block_size: int
    pinned_fraction: float = 0.5
    shards: int = 1
    max_store_bytes: int = DEFAULT_MAX_STORE_BYTES
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """(tenant namespace, weight) of tenants whose share of pinned KV is not 1."""
    tenant_max_sessions: tuple[tuple[str, int], ...] = ()
    """(tenant namespace, conversations kept for it across all shards)."""
    max_responses: int = 100_000
    """Stored Responses API objects kept across all shards."""
    max_response_bytes: int = 256 << 20
    response_ttl_s: float = 86400.0
    """A stored response unused this long is forgotten."""

    def store_kwargs(self) -> dict[str, Any]:
        """One shard's `HandleStore` arguments: the byte bound and the tenants' session
        limits are split among the shards (sessions hash evenly over them)."""
        kwargs = dataclasses.asdict(self)
        for name in ("shards", "max_responses", "max_response_bytes", "response_ttl_s"):
            kwargs.pop(name)
        kwargs["max_store_bytes"] = max(1, self.max_store_bytes // self.shards)
        kwargs["tenant_weights"] = dict(self.tenant_weights)
        kwargs["tenant_max_sessions"] = {t: max(1, -(-n // self.shards)) for t, n in self.tenant_max_sessions}
        return kwargs

    def response_kwargs(self) -> dict[str, Any]:
        """One shard's `ResponseStore` arguments: count and bytes split among the shards."""
        return {
            "max_responses": max(1, self.max_responses // self.shards),
            "max_bytes": max(1, self.max_response_bytes // self.shards),
            "ttl_s": self.response_ttl_s,
        }


BATCH_OPS = ("begin_turn", "end_turn", "end_session")
"""Store operations that travel in a shard's batches."""

MAX_BATCH = 256


def pack(value: Any) -> bytes:
    """A batch or its results as one pickle (the C pickler: several times cheaper per
    object than the general serializer Ray would otherwise run over every claim and
    conversation; Ray then moves a single bytes object)."""
    try:
        return pickle.dumps(value, protocol=5)
    except Exception:
        # An error that does not pickle still reaches its caller, as its description.
        if not isinstance(value, list):
            raise
        return pickle.dumps(
            [(ok, v if ok or _pickles(v) else RuntimeError(repr(v))) for ok, v in value], protocol=5
        )


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value, protocol=5)
        return True
    except Exception:
        return False


def apply_ops(store: HandleStore, ops: Sequence[tuple[str, tuple]] | bytes) -> list[tuple[bool, Any]] | bytes:
    """Run a batch of `(operation, args)` on `store` in order: one `(ok, result or
    exception)` per operation. One operation's error does not stop the others. A packed
    batch (`pack`) gets packed results."""
    if isinstance(ops, bytes):
        return pack(apply_ops(store, pickle.loads(ops)))
    results: list[tuple[bool, Any]] = []
    for name, args in ops:
        if name not in BATCH_OPS:
            results.append((False, ValueError(f"{name!r} is not a batched store operation")))
            continue
        try:
            results.append((True, getattr(store, name)(*args)))
        except Exception as exc:  # returned to that operation's caller
            results.append((False, exc))
    return results


class StoreShard:
    """One shard of the store: a `HandleStore` and a `ResponseStore`. Methods are cheap
    and never block. Runs as a Ray actor (`HandleStoreActor`); plain, it is what tests drive."""

    def __init__(self, settings: StoreSettings):
        store, responses = settings.store_kwargs(), settings.response_kwargs()
        self._settings = {**store, "responses": responses}
        self._store = HandleStore(**store)
        self._responses = ResponseStore(**responses)

    def match(self, prompt_ids: Sequence[int], prompt_text: str | None = None) -> tuple[str | None, int]:
        return self._store.match(prompt_ids, prompt_text)

    def apply(self, ops: list[tuple[str, tuple]] | bytes) -> list[tuple[bool, Any]] | bytes:
        """A batch of per-turn operations from one ingress (`StoreClient`, packed), in order."""
        return apply_ops(self._store, ops)

    def drop_engine(self, engine_id: str) -> int:
        return self._store.drop_engine(engine_id)

    def moving_out(self, engine_id: str) -> list[tuple[float, str]]:
        return self._store.moving_out(engine_id)

    def begin_move(self, session_id: str, engine_id: str) -> Claim | None:
        return self._store.begin_move(session_id, engine_id)

    def end_move(self, lease_id: int, handle: KVHandle | None, decode_replica: str | None) -> str:
        return self._store.end_move(lease_id, handle, decode_replica)

    def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        self._store.set_engine_capacity(engine_id, total_blocks)

    def take_releases(self) -> list:
        return self._store.take_releases()

    # Responses leave the shard detached: whole histories, never the shard's own records.

    def put_response(self, resp: StoredResponse) -> str:
        return self._responses.put(resp)

    def get_response(self, key: str) -> StoredResponse | None:
        resp = self._responses.get(key)
        return resp.detached() if resp is not None else None

    def continue_response(self, key: str, request_id: str) -> tuple[StoredResponse | None, bool]:
        resp, owner = self._responses.continue_from(key, request_id)
        return (resp.detached() if resp is not None else None), owner

    def release_continuation(self, key: str, request_id: str) -> None:
        self._responses.release_continuation(key, request_id)

    def delete_response(self, key: str) -> StoredResponse | None:
        resp = self._responses.delete(key)
        return resp.detached() if resp is not None else None

    def stats(self) -> dict:
        """The shard's state and counters (its stored responses' under `responses`), the
        settings it was built with, and the CPU time its process has used (`cpu_s`, every
        thread: Ray's own work on its calls included), from which a caller can tell what
        the shard costs per operation."""
        return {
            **self._store.stats(),
            "responses": self._responses.stats(),
            "settings": self._settings,
            "cpu_s": time.process_time(),
        }


HandleStoreActor = ray.remote(num_cpus=0, max_restarts=-1)(StoreShard)


@serve.deployment(
    name="SessionStore", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
)
class SessionStore:
    """Owns the shards of one app's store (created here, they share this replica's fate).
    Called by ingress replicas: `shards()` at their first store call and after a failure."""

    def __init__(self, settings: StoreSettings):
        self._settings = settings
        # Beside this replica (soft): the shards follow its placement (`sessions.store_resources`).
        near = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self._shards = [
            HandleStoreActor.options(scheduling_strategy=near).remote(settings)
            for _ in range(settings.shards)
        ]

    def shards(self) -> tuple[StoreSettings, list]:
        """This store's settings and its shard actor handles, in shard order."""
        return self._settings, self._shards

    def __del__(self):
        for shard in getattr(self, "_shards", ()):
            ray.kill(shard, no_restart=True)


def shard_of(session_id: str, shards: int) -> int:
    return zlib.crc32(session_id.encode()) % shards


ShardSource = Callable[[], Awaitable[tuple[StoreSettings, list]]]


class StoreClient:
    """Ingress-side view of the sharded store. Every method raises `StoreUnavailable`
    when the store cannot answer within `timeout_s`."""

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
        self._queues: dict[int, _ShardQueue] = {}
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
                self._queues = {i: _ShardQueue(a, self._call) for i, a in enumerate(actors)}
        return self._actors

    async def _call(self, ref) -> Any:
        try:
            return await asyncio.wait_for(ref, self._timeout)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            # The shard is restarting or its owner is gone: fetch the shards again next time.
            self._actors = None
            raise StoreUnavailable(f"store call failed: {exc!r}") from exc

    async def _on_shard(self, key: str) -> Any:
        """The shard actor that keeps response `key`: its chain's (`route_of`)."""
        actors = await self._shards()
        return actors[shard_of(route_of(key), len(actors))]

    async def _batched(self, session_id: str, op: str, *args) -> Any:
        actors = await self._shards()
        queued = self._queues[shard_of(session_id, len(actors))].submit(op, args)
        try:
            # Queued behind the batches in flight (each bound by a call deadline, and sent
            # in order), then sent itself: two deadlines at most.
            return await asyncio.wait_for(queued, 2 * self._timeout)
        except TimeoutError as exc:
            raise StoreUnavailable(f"store {op} got no answer in {2 * self._timeout:.0f} s") from exc

    async def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None = None
    ) -> tuple[str | None, int]:
        actors = await self._shards()
        results = await asyncio.gather(
            *(self._call(a.match.remote(list(prompt_ids), prompt_text)) for a in actors)
        )
        return max(results, key=lambda r: (r[0] is not None, r[1]))

    async def begin_turn(self, session_id: str) -> Claim:
        held = self._recent.get(session_id)
        known = held.handle.request_id if held is not None and held.handle is not None else None
        claim = await self._batched(session_id, "begin_turn", session_id, known)
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
        actors = await self._shards()
        share = max(1, engine_blocks // len(actors)) if engine_blocks else None
        await self._batched(claim.session_id, "end_turn", claim.lease_id, outcome, sent, share, retain)
        if conversation is not None and conversation.handle is not None:
            self._recent[claim.session_id] = conversation
            while len(self._recent) > self.RECENT:
                self._recent.popitem(last=False)

    async def drop_engine(self, engine_id: str) -> int:
        actors = await self._shards()
        return sum(await asyncio.gather(*(self._call(a.drop_engine.remote(engine_id)) for a in actors)))

    async def moving_out(self, engine_id: str) -> list[str]:
        """The sessions whose stored handle pins blocks on `engine_id`, every shard's,
        most recently stored first (shards on one node share the monotonic clock)."""
        actors = await self._shards()
        shards = await asyncio.gather(*(self._call(a.moving_out.remote(engine_id)) for a in actors))
        return [session for _, session in sorted((e for shard in shards for e in shard), reverse=True)]

    async def begin_move(self, session_id: str, engine_id: str) -> Claim | None:
        actors = await self._shards()
        shard = actors[shard_of(session_id, len(actors))]
        return await self._call(shard.begin_move.remote(session_id, engine_id))

    async def end_move(self, claim: Claim, handle: KVHandle | None, decode_replica: str | None) -> str:
        actors = await self._shards()
        shard = actors[shard_of(claim.session_id, len(actors))]
        return await self._call(shard.end_move.remote(claim.lease_id, handle, decode_replica))

    async def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        """The engine's blocks are split evenly among the shards: each keeps its own pins
        on that engine within its part of the budget, so together they stay within it."""
        actors = await self._shards()
        share = max(1, total_blocks // len(actors))
        await asyncio.gather(*(self._call(a.set_engine_capacity.remote(engine_id, share)) for a in actors))

    async def take_releases(self) -> list:
        actors = await self._shards()
        shards = await asyncio.gather(*(self._call(a.take_releases.remote()) for a in actors))
        return [r for shard in shards for r in shard]

    async def end_session(self, session_id: str) -> bool:
        self._recent.pop(session_id, None)
        return await self._batched(session_id, "end_session", session_id)

    # -- stored responses (`connector.response_store`), on the shard their key hashes to ------

    async def put_response(self, resp: StoredResponse, history: list[dict] | None = None) -> str:
        """Store a response that keeps only what it added over `resp.parent_key`. If the
        shard no longer has the parent (evicted, or the shard restarted), it is stored
        again standing alone with `history` (the parent's whole conversation, as
        `continue_response` gave it). Returns `ResponseStore.put`'s answer."""
        shard = await self._on_shard(resp.key)
        result = await self._call(shard.put_response.remote(resp))
        if result == "no_parent" and history is not None:
            alone = dataclasses.replace(resp, messages=history + resp.messages, parent_key=None)
            result = await self._call(shard.put_response.remote(alone))
        return result

    async def get_response(self, key: str) -> StoredResponse | None:
        return await self._call((await self._on_shard(key)).get_response.remote(key))

    async def continue_response(self, key: str, request_id: str) -> tuple[StoredResponse | None, bool]:
        """The response and whether `request_id` owns its continuation (the first request
        to continue it does; another one forks: the caller runs it in a new session)."""
        return await self._call((await self._on_shard(key)).continue_response.remote(key, request_id))

    async def release_continuation(self, key: str, request_id: str) -> None:
        """Give back a continuation `request_id` owns: it failed before storing its response."""
        await self._call((await self._on_shard(key)).release_continuation.remote(key, request_id))

    async def delete_response(self, key: str) -> StoredResponse | None:
        return await self._call((await self._on_shard(key)).delete_response.remote(key))

    async def stats(self) -> dict:
        actors = await self._shards()
        shards = await asyncio.gather(*(self._call(a.stats.remote()) for a in actors))
        return {"shards": shards}


class _ShardQueue:
    """The per-turn operations bound for one shard. Up to `MAX_IN_FLIGHT` batches are in
    flight at once (Ray runs one caller's calls to an actor in the order they were sent);
    what arrives while all are out leaves together in the next batch. A burst is split
    among the senders free to take it, so the shard works on one part while the answers
    to another are on their way back (one large batch would leave the shard idle while
    its callers prepare their next operations, then the callers idle while it works).
    A failed batch fails each of its operations with `StoreUnavailable`."""

    MAX_IN_FLIGHT = 4

    def __init__(self, actor, call: Callable[[Any], Awaitable[Any]]):
        self._actor = actor
        self._call = call
        self._pending: list[tuple[str, tuple, asyncio.Future]] = []
        self._senders: set[asyncio.Task] = set()
        self._free = 0
        """Senders started and not waiting for an answer: the ways a burst is split."""

    def submit(self, op: str, args: tuple) -> asyncio.Future:
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

    async def _send_batch(self, batch: list[tuple[str, tuple, asyncio.Future]]) -> None:
        try:
            results = pickle.loads(
                await self._call(self._actor.apply.remote(pack([(op, args) for op, args, _ in batch])))
            )
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
