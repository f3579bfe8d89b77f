"""The handle store as Ray actors, and the client every ingress replica uses.

Handles live in `HandleStoreActor`s (named, detached, one per shard) so all ingress
replicas share them and a restarted ingress finds them again. Sessions are sharded by a
stable hash of their id; a sessionless prompt is matched against every shard.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Sequence

import ray

from connector.store import Claim, Conversation, HandleStore, TurnOutcome

NAMESPACE = "kvturn"


@ray.remote(num_cpus=0, max_restarts=-1)
class HandleStoreActor:
    """One shard of the store. Methods are cheap and never block."""

    def __init__(self, **store_kwargs):
        self._store = HandleStore(**store_kwargs)

    def match(self, prompt_ids: Sequence[int], prompt_text: str | None = None) -> tuple[str | None, int]:
        return self._store.match(prompt_ids, prompt_text)

    def begin_turn(self, session_id: str) -> Claim:
        return self._store.begin_turn(session_id)

    def end_turn(self, lease_id: int, outcome: TurnOutcome, conversation: Conversation | None) -> None:
        self._store.end_turn(lease_id, outcome, conversation)

    def drop_engine(self, engine_id: str) -> int:
        return self._store.drop_engine(engine_id)

    def stats(self) -> dict:
        return self._store.stats()


def shard_of(session_id: str, shards: int) -> int:
    return zlib.crc32(session_id.encode()) % shards


class StoreClient:
    """Ingress-side view of the sharded store."""

    def __init__(self, actors: list):
        self._actors = actors

    @classmethod
    def connect(cls, app_name: str, shards: int, **store_kwargs) -> "StoreClient":
        """Get or create the shards of `app_name`'s store."""
        actors = [
            HandleStoreActor.options(
                name=f"handle-store-{app_name}-{i}",
                namespace=NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
            ).remote(**store_kwargs)
            for i in range(shards)
        ]
        return cls(actors)

    def _shard(self, session_id: str):
        return self._actors[shard_of(session_id, len(self._actors))]

    async def match(self, prompt_ids: Sequence[int], prompt_text: str | None = None) -> tuple[str | None, int]:
        results = await asyncio.gather(*(a.match.remote(list(prompt_ids), prompt_text) for a in self._actors))
        return max(results, key=lambda r: (r[0] is not None, r[1]))

    async def begin_turn(self, session_id: str) -> Claim:
        return await self._shard(session_id).begin_turn.remote(session_id)

    async def end_turn(self, claim: Claim, outcome: TurnOutcome, conversation: Conversation | None) -> None:
        await self._shard(claim.session_id).end_turn.remote(claim.lease_id, outcome, conversation)

    async def drop_engine(self, engine_id: str) -> int:
        return sum(await asyncio.gather(*(a.drop_engine.remote(engine_id) for a in self._actors)))

    async def stats(self) -> dict:
        shards = await asyncio.gather(*(a.stats.remote() for a in self._actors))
        return {"shards": shards}
