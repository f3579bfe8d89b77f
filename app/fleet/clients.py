"""How the ingress reaches the rest of the graph: the engine replicas through their Serve
deployment handles (`ServeEngineClients`, the production `app.turn.turns.EngineClients` and
`app.fleet.memory.DecodeMemoryClients`), and the handle store's settings for a config."""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from app.api.auth import ApiKeys
from app.config import AppConfig
from app.engines.wire import EngineChunk, EngineRequest, ReplicaQuery
from app.fleet.routing import LiveReplicas
from connector.settings import StoreSettings


class ServeEngineClients:
    """`EngineClients` over Serve deployment handles.

    A session's replica (`preferred_replica`, the replica of a handle to release or
    count) is a decode replica, or a prefill replica that hosts the session
    (`transfer.prefill_hosts`): each call goes to the deployment whose routers list that
    replica as running."""

    def __init__(
        self,
        prefill: DeploymentHandle | None,
        decode: DeploymentHandle,
        decode_live: LiveReplicas,
        prefill_live: LiveReplicas | None = None,
    ):
        self._prefill = prefill
        self._prefill_stream = prefill.options(stream=True) if prefill is not None else None
        self._decode = decode.options(stream=True)
        self._decode_calls = decode
        self._decode_live = decode_live
        self._prefill_live = prefill_live

    def hosts_on_prefill(self, replica_id: str | None) -> bool:
        """Whether `replica_id` is a running prefill replica (one that can host sessions)."""
        if not replica_id or self._prefill_live is None:
            return False
        return self._prefill_live.alive(replica_id) is True

    def prefill_replicas(self) -> frozenset[str] | None:
        return self._prefill_live.running() if self._prefill_live is not None else None

    def _calls(self, replica_id: str) -> DeploymentHandle:
        if self.hosts_on_prefill(replica_id):
            assert self._prefill is not None
            return self._prefill
        return self._decode_calls

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk, str]:
        assert self._prefill is not None  # called in P/D modes only, which have prefill
        return await self._prefill.prefill.remote(request)

    async def decode(self, request: EngineRequest):
        streams = self._decode
        if self._prefill_stream is not None and self.hosts_on_prefill(request.preferred_replica):
            streams = self._prefill_stream
        async for item in streams.generate.remote(request):
            yield item

    def decode_alive(self, replica_id: str) -> bool | None:
        if self.hosts_on_prefill(replica_id):
            return True
        return self._decode_live.alive(replica_id)

    async def decode_stopping(self, replica_id: str) -> bool:
        """Whether the session's replica, out of the running set, still lives (Serve drains
        it): a decode replica, or a prefill replica that hosted sessions."""
        if await self._decode_live.stopping(replica_id):
            return True
        return self._prefill_live is not None and await self._prefill_live.stopping(replica_id)

    def decode_replicas(self) -> frozenset[str] | None:
        return self._decode_live.running()

    async def decode_kv_blocks(self, replica_id: str) -> dict | None:
        return await self._calls(replica_id).kv_blocks.remote(ReplicaQuery(replica_id))

    async def release(self, replica_id: str, request_ids) -> list[str]:
        return await self._calls(replica_id).release.remote(ReplicaQuery(replica_id), list(request_ids))


def store_settings(cfg: AppConfig) -> StoreSettings:
    """The handle store's settings for a config (the builder binds `SessionStore` with
    them; the ingress checks the running store has them)."""
    s = cfg.sessions
    tenants = ApiKeys.of(cfg.access).tenants()
    return StoreSettings(
        handle_ttl_s=s.handle_ttl_s,
        decoder_ttl_s=cfg.transfer.decoder_kv_blocks_ttl_s,
        max_sessions=s.max_sessions,
        max_blocks_per_engine=s.max_pinned_blocks_per_engine,
        index_block_size=cfg.block_size,
        pinned_fraction=s.pinned_fraction,
        shards=s.store_shards,
        max_store_bytes=s.max_store_bytes,
        tenant_weights=tuple((t.namespace, t.policy.weight) for t in tenants if t.policy.weight != 1.0),
        tenant_max_sessions=tuple(
            (t.namespace, t.policy.max_sessions) for t in tenants if t.policy.max_sessions
        ),
        max_responses=cfg.responses.max_responses,
        max_response_bytes=cfg.responses.max_bytes,
        response_ttl_s=cfg.responses.ttl_s,
    )
