"""The handle store's operations, declared once: what each one is called, which shard
runs it, and the async surface an ingress sees.

Pure Python, no Ray: `app.turn` (which must run without Ray) types its store seam with
the protocols here. Who uses what:

* `StoreOp`: every operation a shard runs, with its `Route` (which shard, batched or
  not) and the `Part` of the shard that implements it. `connector.shard.StoreShard`
  runs any of them by name (`call`, or `apply` for a batch); `connector.client.StoreClient`
  sends each one where its route says. A new operation is a member here, its method on
  `HandleStore` (or `ResponseStore`), and the client's method that adapts its arguments.
* `StoreApi` and its parts (`TurnStore`, `MoveStore`, `MemoryStore`, `ResponseApi`):
  the ingress-side calls, each raising `StoreUnavailable` when the store cannot answer in
  time. `StoreClient` implements `StoreApi`; `app.turn.model.Store`,
  `app.fleet.memory.MemoryStore` and the tests' fakes implement the parts they need.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from connector.handle import KVHandle
from connector.records import Claim, Conversation, Release, TurnOutcome
from connector.response_store import StoredResponse

STORE_CALL_TIMEOUT_S = 5.0
"""Deadline of one store call from the ingress; past it the turn goes on without reuse."""


class StoreUnavailable(Exception):
    """A store call failed or timed out (shard restarting or gone, store redeploying)."""


def shard_of(key: str, shards: int) -> int:
    """The shard of a session id (or of a response chain's route, `route_of`)."""
    return zlib.crc32(key.encode()) % shards


class Route(Enum):
    """Which shard runs an operation, and how it travels."""

    BATCHED = "batched"
    """The shard of the session (the first argument), in that shard's next batch of
    per-turn operations (`connector.shard_queue`), in arrival order."""
    SESSION = "session"
    """The shard of the session (the first argument), a call of its own."""
    RESPONSE = "response"
    """The shard of the response key's chain (`connector.response_store.route_of`)."""
    ALL = "all"
    """Every shard; the client combines their answers."""


class Part(Enum):
    """The part of a shard that implements an operation."""

    HANDLES = "handles"
    """`connector.store.HandleStore`."""
    RESPONSES = "responses"
    """`connector.response_store.ResponseStore`; what it hands out leaves detached."""
    SHARD = "shard"
    """The shard itself (`StoreShard.stats`: both parts, settings, CPU time)."""


class StoreOp(Enum):
    """A shard's operations. The value is the name on the wire (a batch carries it);
    `method` is the implementing method of the `part`."""

    route: Route
    part: Part
    method: str

    def __new__(
        cls, name: str, route: Route, part: Part = Part.HANDLES, method: str | None = None
    ) -> StoreOp:
        op = object.__new__(cls)
        op._value_ = name
        op.route = route
        op.part = part
        op.method = method or name
        return op

    @classmethod
    def of(cls, op: StoreOp | str) -> StoreOp:
        """The operation of a wire name (or the operation itself); ValueError if none."""
        found = op if isinstance(op, StoreOp) else cls._value2member_map_.get(op)
        if not isinstance(found, StoreOp):
            raise ValueError(f"{op!r} is not a store operation")
        return found

    # Turns.
    MATCH = "match", Route.ALL
    BEGIN_TURN = "begin_turn", Route.BATCHED
    END_TURN = "end_turn", Route.BATCHED
    END_SESSION = "end_session", Route.BATCHED
    # A decode replica gone, or moving its conversations to a peer (`app.fleet.drain`).
    DROP_ENGINE = "drop_engine", Route.ALL
    MOVING_OUT = "moving_out", Route.ALL
    BEGIN_MOVE = "begin_move", Route.SESSION
    END_MOVE = "end_move", Route.SESSION
    # Decode memory (`app.fleet.memory`).
    SET_ENGINE_CAPACITY = "set_engine_capacity", Route.ALL
    TAKE_RELEASES = "take_releases", Route.ALL
    # Stored Responses API objects.
    PUT_RESPONSE = "put_response", Route.RESPONSE, Part.RESPONSES, "put"
    GET_RESPONSE = "get_response", Route.RESPONSE, Part.RESPONSES, "get"
    CONTINUE_RESPONSE = "continue_response", Route.RESPONSE, Part.RESPONSES, "continue_from"
    RELEASE_CONTINUATION = "release_continuation", Route.RESPONSE, Part.RESPONSES
    DELETE_RESPONSE = "delete_response", Route.RESPONSE, Part.RESPONSES, "delete"
    # Figures for metrics and operators.
    STATS = "stats", Route.ALL, Part.SHARD


# -- the ingress-side surface: each call raises `StoreUnavailable` when the store cannot answer


class MemoryStore(Protocol):
    """The decode-memory hooks (`app.fleet.memory`)."""

    async def set_engine_capacity(self, engine_id: str, total_blocks: int) -> None:
        """The engine has `total_blocks` KV blocks (split among the shards)."""
        ...

    async def take_releases(self) -> list[Release]:
        """Handles that left unread since the last call: `Release(engine_id, request_id,
        decode_replica, num_blocks, reason)`, every shard's."""
        ...


class TurnStore(MemoryStore, Protocol):
    """What a turn calls (`app.turn`), the decode-memory hooks included."""

    async def match(
        self, prompt_ids: Sequence[int], prompt_text: str | None = None
    ) -> tuple[str | None, int]:
        """The stored session a sessionless prompt continues, and how many of its tokens
        agree: the best of every shard's."""
        ...

    async def begin_turn(self, session_id: str) -> Claim: ...

    async def end_turn(
        self,
        claim: Claim,
        outcome: TurnOutcome,
        conversation: Conversation | None,
        engine_blocks: int | None = None,
        retain: bool = False,
    ) -> None: ...

    async def drop_engine(self, engine_id: str) -> int:
        """Forget every stored handle on the engine (its replica is gone); how many."""
        ...


class MoveStore(Protocol):
    """A drain's calls (`app.fleet.drain`)."""

    async def moving_out(self, engine_id: str) -> list[str]: ...

    async def begin_move(self, session_id: str, engine_id: str) -> Claim | None: ...

    async def end_move(self, claim: Claim, handle: KVHandle | None, decode_replica: str | None) -> str: ...

    async def drop_engine(self, engine_id: str) -> int: ...


class ResponseApi(Protocol):
    """Stored Responses API objects, on the shard their chain hashes to."""

    async def put_response(self, resp: StoredResponse, history: list[dict] | None = None) -> str: ...

    async def get_response(self, key: str) -> StoredResponse | None: ...

    async def continue_response(self, key: str, request_id: str) -> tuple[StoredResponse | None, bool]: ...

    async def release_continuation(self, key: str, request_id: str) -> None: ...

    async def delete_response(self, key: str) -> StoredResponse | None: ...


class StoreApi(TurnStore, MoveStore, ResponseApi, Protocol):
    """The whole store as an ingress sees it (`connector.client.StoreClient`)."""

    async def end_session(self, session_id: str) -> bool: ...

    async def stats(self) -> dict:
        """`{"shards": [StoreShard.stats(), ...]}`."""
        ...
