"""Engine replicas: Ray Serve deployments that each own one vLLM engine.

`PrefillServer` runs the prefill leg of a turn (one token, KV kept for decode);
`DecodeServer` reads the prompt's KV and streams the answer. Both are called only by the
ingress, through deployment handles, with `EngineRequest`s whose transfer params were
built by `connector.handle`. Each replica reports its Serve replica id with its output,
which the ingress stores with the session for affinity on the next turn.

Lifetime: the engine's processes die with the replica. Serve's graceful shutdown calls
`__del__`, which shuts the engine down; a replica that dies any other way leaves the
engine core to `connector.vllm_plugin`'s lifetime guard, armed by `KVTURN_OWNER_PID`
(this process). `check_health` (called by Serve every `health_check_period_s`) fails once
the engine is dead, and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

import ray
from ray import serve

from app.config import AppConfig, EngineRoleConfig
from app.engines.engine import VLLMEngine
from app.engines.wire import Engine, EngineChunk, EngineInfo, EngineRequest, ReplicaQuery
from app.fleet.autoscaling import KV_IN_USE, QUEUED_TOKENS
from app.fleet.clients import store_settings
from app.fleet.drain import Drain, last_of
from connector import vllm_plugin
from connector.client import StoreClient

logger = logging.getLogger("ray.serve").getChild(__name__)

STORE_DEPLOYMENT = "SessionStore"
DECODE_DEPLOYMENT = "DecodeServer"
DRAIN_SLACK_S = 5.0
"""Beyond `drain.budget_s`: the store calls before and after the moves."""
PREFILL_READ_WAIT_S = 10.0
"""How long a stopping prefill replica waits for decode engines to read its last legs' KV."""


def _peers_running(app: str, deployment: str) -> bool:
    """Whether the app stays up with another running replica of `deployment` (not when
    the whole app is being deleted or every replica stops)."""
    status = serve.status().applications.get(app)
    if status is None or status.status == "DELETING":
        return False
    running = status.deployments[deployment].replica_states.get("RUNNING", 0)
    return running > 0


class EngineServer:
    """Shared body of both roles. `engine` is injectable for tests of this class."""

    role = "engine"

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, cfg: AppConfig, role_cfg: EngineRoleConfig, *, transfer: bool, engine: Engine | None = None
    ):
        self._cfg = cfg
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        node_ip = ray.util.get_node_ip_address()
        # Read by the lifetime guard in the engine's processes (spawned with this env).
        os.environ[vllm_plugin.ENV_OWNER_PID] = str(os.getpid())
        self._engine = engine or VLLMEngine(
            cfg, role_cfg, name=f"{self.role}-{self.replica_id}", transfer=transfer, node_ip=node_ip
        )
        await self._engine.start()
        logger.info("%s replica %s ready (engine %s)", self.role, self.replica_id, self.info().engine_id)

    def info(self) -> EngineInfo:
        return EngineInfo(
            replica_id=self.replica_id,
            engine_id=self._engine.engine_id,
            side_channel=self._engine.side_channel,
            kv_blocks_total=self._engine.kv_blocks_total,
        )

    def stats(self, query: ReplicaQuery | None = None) -> dict:
        """Cumulative prompt-token counts: computed, local prefix hits, pulled over NIXL.

        Pass a `ReplicaQuery` to reach a given replica (the router honours it)."""
        c = self._engine.counts()
        info = self.info()
        return {
            "replica_id": self.replica_id,
            "engine_id": info.engine_id,
            "node_ip": ray.util.get_node_ip_address(),
            "side_channel": list(info.side_channel) if info.side_channel else None,
            "prompt_tokens_total": c.total,
            "prompt_tokens_computed": c.computed,
            "prompt_tokens_local_hit": c.local_cache_hit,
            "prompt_tokens_external": c.external_kv_transfer,
            "requests": c.requests,
            "kv_cache_usage": c.kv_cache_usage,
            "kv_transfers": c.transfers,
            "kv_transfer_s": round(c.transfer_s, 4),
            "kv_transfer_bytes": c.transfer_bytes,
            "kv_failed_transfers": c.failed_transfers,
            "kv_expired_pins": c.expired_pins,
            "kv_reads_after_release": c.reads_after_release,
            "engine_busy_steps": c.busy_steps,
            "engine_busy_step_s": round(c.busy_step_s, 4),
            "engine_prompt_steps": c.prompt_steps,
            "engine_prompt_step_s": round(c.prompt_step_s, 4),
            "engine_busy_step_seqs": c.busy_step_seqs,
            **self._cpu_stats(),
        }

    def _cpu_stats(self) -> dict:
        plan = self._engine.cpu_plan
        return {"cpu_threads": plan.threads, "cpu_binding": plan.bind} if plan else {}

    async def cpu_in_use(self, query: ReplicaQuery | None = None) -> dict | None:
        """OpenMP threads the engine's worker really runs and the cores its model thread may
        use, read back from the worker (`VLLMEngine.cpu_in_use`)."""
        return await self._engine.cpu_in_use()

    async def _run(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        finished = False
        try:
            async for chunk in self._engine.generate(request):
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the caller went away: free the engine's slot and blocks
                await self._engine.abort(request.request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[tuple[EngineChunk, str]]:
        """Stream the answer. Called with `handle.options(stream=True)`; every item
        carries this replica's id, the last one the engine's final transfer params. A
        prefill replica answers too: it then hosts the session (`transfer.prefill_hosts`)."""
        async for chunk in self._run(request):
            yield chunk, self.replica_id

    async def kv_blocks(self, query: ReplicaQuery | None = None) -> dict | None:
        """This replica's engine id and its KV blocks from the engine's own block pool
        (`total`, `free`, `pinned`, `pinned_requests`); None if the engine cannot tell.
        Pass a `ReplicaQuery` to reach a given replica."""
        blocks = await self._engine.kv_blocks()
        if blocks is None:
            return None
        return {"replica_id": self.replica_id, "engine_id": self.info().engine_id, **asdict(blocks)}

    async def release(self, query: ReplicaQuery, request_ids: list[str]) -> list[str]:
        """Free now the blocks this engine pins for `request_ids`: finished turns whose
        handle the store let go unread (evicted, superseded, expired, dropped, session
        ended). Called by the ingress with the replica that holds them in `query`.
        Returns the ids released; ids not pinned here are ignored (already read or
        expired, or another replica's when the router could not reach the wanted one).
        Never raises: the blocks then stay pinned until the engine's own TTL."""
        try:
            return await self._engine.release(request_ids)
        except Exception:
            logger.exception(
                "%s replica %s could not release %d pinned requests",
                self.role,
                self.replica_id,
                len(request_ids),
            )
            return []

    async def _hand_over(self, engine: Engine) -> None:
        """Move the conversations this engine pins to the running decode replicas
        (`app.fleet.drain.Drain`, within `drain.budget_s`): a stopping decode replica's, or a
        stopping prefill replica's that hosted sessions. Never raises: what is not moved is
        dropped from the store, and its next turn recomputes."""
        try:
            await engine.check_health()  # a dead engine has nothing left to read
            await asyncio.wait_for(self._drain(), self._cfg.drain.budget_s + DRAIN_SLACK_S)
        except Exception:
            logger.exception(
                "%s replica %s could not hand its conversations over", self.role, self.replica_id
            )

    async def _drain(self) -> None:
        app = serve.get_replica_context().app_name
        if not await asyncio.to_thread(_peers_running, app, DECODE_DEPLOYMENT):
            logger.info(
                "%s replica %s stops with no running decode peer: nothing to move", self.role, self.replica_id
            )
            return
        store = StoreClient.of_deployment(
            serve.get_deployment_handle(STORE_DEPLOYMENT, app), store_settings(self._cfg)
        )
        peers = serve.get_deployment_handle(DECODE_DEPLOYMENT, app).options(stream=True)

        async def move(request: EngineRequest) -> tuple[EngineChunk | None, str | None]:
            return await last_of(peers.generate.remote(request))

        await Drain(self._cfg, self.info().engine_id, self.replica_id, store, move).run()

    async def check_health(self) -> None:
        """Serve's health check: raises once the engine is dead (its core process exited
        or its output loop failed), so Serve stops routing here and replaces the replica."""
        await self._engine.check_health()

    def __del__(self):
        """Serve's graceful shutdown (and garbage collection) end the engine's processes."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            self._engine = None
            engine.shutdown()


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineServer):
    role = "prefill"
    queued_tokens = 0
    """New prompt tokens of the legs in flight here (`app.fleet.autoscaling`)."""

    async def prefill(self, request: EngineRequest) -> tuple[EngineChunk | None, str]:
        """Compute the prompt (pulling what the transfer params allow) and keep its KV
        for a decode engine. Returns the final output (None if the engine gave none) and
        this replica's id."""
        history = int((request.kv_params or {}).get("remote_num_tokens") or 0)
        new_tokens = max(1, len(request.prompt_token_ids) - history)
        self.queued_tokens += new_tokens
        try:
            return await self._prefill(request)
        finally:
            self.queued_tokens -= new_tokens

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling metrics hook (called only when the role autoscales)."""
        return {QUEUED_TOKENS: float(self.queued_tokens)}

    async def __del__(self):  # type: ignore[override]  # Serve awaits an async destructor
        """Serve's graceful shutdown, once the legs and hosted answers in flight finished:
        the sessions it hosts (`transfer.prefill_hosts`) go to the decode replicas as a
        stopping decode replica's do; the KV of the last legs may not have been read by
        their decode engines yet, so wait (up to `PREFILL_READ_WAIT_S`) until no block is
        pinned for a reader, then end the engine."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        if self._cfg.prefill_hosts and self._cfg.drain.migrate:
            await self._hand_over(engine)
        deadline = time.monotonic() + PREFILL_READ_WAIT_S
        try:
            while time.monotonic() < deadline:
                blocks = await engine.kv_blocks()
                if blocks is None or not blocks.pinned_requests:
                    break
                await asyncio.sleep(0.05)
        except Exception:
            logger.exception("prefill replica %s could not read its pinned blocks", self.replica_id)
        super().__del__()

    async def _prefill(self, request: EngineRequest) -> tuple[EngineChunk | None, str]:
        last, timings = None, None
        async for chunk in self._run(request):
            last, timings = chunk, chunk.engine_timings or timings
        if last is not None and last.engine_timings is None and timings is not None:
            last = replace(last, engine_timings=timings)
        return last, self.replica_id


@serve.deployment(name=DECODE_DEPLOYMENT)
class DecodeServer(EngineServer):
    role = "decode"

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling metrics hook (called only when the role autoscales): the
        share of the engine's KV blocks in use, running requests and pinned conversations."""
        blocks = await self._engine.kv_blocks()
        if blocks is None or not blocks.total:
            return {}
        return {KV_IN_USE: (blocks.total - blocks.free) / blocks.total}

    async def __del__(self):  # type: ignore[override]  # Serve awaits an async destructor
        """Serve's graceful shutdown, once the in-flight answers finished: hand the
        conversations this engine pins to the surviving decode replicas (`app.fleet.drain`),
        then end the engine."""
        engine = getattr(self, "_engine", None)
        if engine is None:
            return
        if self._cfg.reuses_kv and self._cfg.drain.migrate:
            await self._hand_over(engine)
        super().__del__()
