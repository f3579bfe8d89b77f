"""The app's Prometheus metrics, through Ray's metrics system.

Every metric is a `ray.util.metrics` Counter, Gauge or Histogram, as Ray Serve and Ray
Serve LLM do: each Ray node exports them in Prometheus format on its metrics export port
(`ray start --metrics-export-port=8080`), beside Serve's own `ray_serve_*` metrics and
vLLM's `ray_vllm_*` engine metrics (`VLLMEngine` adds vLLM's `RayPrometheusStatLogger`).
Ray prefixes every name with `ray_` and counters get `_total`: `kvturn_tokens_pulled` is
scraped as `ray_kvturn_tokens_pulled_total`. Ray flushes metrics every few seconds; they are tagged by
Ray with the node and the worker process besides the tags below.

Who records what:

* `TurnMetrics` (one per ingress replica): per turn, at its end (`record_turn`): TTFT by
  turn-index bucket and mode, prompt tokens pulled from decode / cached / computed, the
  miss reason; and every `POLL_S` (`ensure_polling`) the orchestration's event counters
  (`sync_events`: pull timeouts, retries, failed legs, placement choices, ...) and the handle store's state
  (`StoreGauges`). Store call latency: `TimedStore`, a wrapper of the store client.
* `EngineMetrics` (one per engine, fed by vLLM's stat-logger hook in `app.engines.engine`): KV
  blocks in use (for a decode engine with nothing running: the blocks it pins for the
  next turn's pull), running requests, NIXL reads, their bytes, seconds and failures.

Creating and recording metrics is cheap and never raises when Ray is not initialised
(unit tests): the calls are then no-ops.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import Counter as _Counts
from collections.abc import Mapping, Sequence
from typing import Any

from ray.util import metrics as ray_metrics

from app.turn.events import CONTINUED_FROM
from app.turn.placement import ON_DECODE, Reason
from connector.store_api import StoreOp

logger = logging.getLogger("ray.serve").getChild(__name__)

HOP_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 40.0]
TTFT_BOUNDARIES = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
STORE_BOUNDARIES = [0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0]
TURN_BUCKETS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"))
POLL_S = 5.0
PLACED = "placed_"
"""Prefix of the placement counters of `Turns.counts` (`placed_<app.turn.placement.Reason>`)."""


def turn_bucket(index: int | None) -> str:
    """Tag value of a turn index (1-based): 1, 2, 3-4, 5-8, 9-16, 17+; `unknown` if None."""
    if index is None or index < 1:
        return "unknown"
    for upper, label in TURN_BUCKETS:
        if index <= upper:
            return label
    return "17+"


def chat_turn_index(messages: Sequence[Any]) -> int:
    """The turn a chat request is in the conversation: assistant messages sent + 1."""
    return 1 + sum(
        1
        for m in messages
        if (m.get("role") if isinstance(m, dict) else getattr(m, "role", None)) == "assistant"
    )


def turn_hops(timings: Mapping[str, float]) -> dict[str, float]:
    """A turn's time to first token split into its hops (`TurnResult.timings`): `store`
    (session resolved), `verify` (handle checked against the prompt), `prefill_engine`
    (the prefill engine's own span: queue, compute, NIXL read of the history),
    `prefill_transport` (the rest of the prefill leg: Serve call, routing), `decode_engine`
    (the decode engine's span to its first token, its KV read included) and
    `decode_transport` (the rest). Hops whose inputs are missing are left out."""
    t = dict(timings)
    hops: dict[str, float] = {}
    if "store_s" in t:
        hops["store"] = t["store_s"]
        if "session_s" in t:
            hops["verify"] = t["session_s"] - t["store_s"]
    leg_start = t.get("session_s")
    if "prefill_s" in t and leg_start is not None:
        if "prefill_engine_s" in t:
            hops["prefill_engine"] = t["prefill_engine_s"]
            hops["prefill_transport"] = t["prefill_s"] - leg_start - t["prefill_engine_s"]
        leg_start = t["prefill_s"]
    if "first_token_s" in t and leg_start is not None and "decode_engine_s" in t:
        hops["decode_engine"] = t["decode_engine_s"]
        hops["decode_transport"] = t["first_token_s"] - leg_start - t["decode_engine_s"]
    return {k: max(0.0, round(v, 5)) for k, v in hops.items()}


class TurnMetrics:
    """Turn-level metrics of one ingress replica. `record_turn` is called once per
    finished turn (from the event loop; it never blocks)."""

    def __init__(self, mode: str):
        self._mode = mode
        tags = ("mode", "turn")
        self.turns = ray_metrics.Counter("kvturn_turns", "Turns answered.", tag_keys=tags)
        self.ttft = ray_metrics.Histogram(
            "kvturn_ttft_seconds",
            "Time from a turn's arrival at the ingress to decode's first output.",
            boundaries=TTFT_BOUNDARIES,
            tag_keys=tags,
        )
        self.hops = ray_metrics.Histogram(
            "kvturn_turn_hop_seconds",
            "Where a turn's time to first token went, by hop (`app.api.metrics.turn_hops`).",
            boundaries=HOP_BOUNDARIES,
            tag_keys=("mode", "hop"),
        )
        self.prompt_tokens = ray_metrics.Counter(
            "kvturn_prompt_tokens", "Prompt tokens of answered turns.", tag_keys=tags
        )
        self.pulled = ray_metrics.Counter(
            "kvturn_tokens_pulled",
            "Prompt tokens of history prefill read from a decode engine over NIXL.",
            tag_keys=tags,
        )
        self.cached = ray_metrics.Counter(
            "kvturn_tokens_cached",
            "Prompt tokens not computed in their turn (pulled plus local prefix hits; usage.cached_tokens).",
            tag_keys=tags,
        )
        self.computed = ray_metrics.Counter(
            "kvturn_tokens_computed", "Prompt tokens computed in their turn.", tag_keys=tags
        )
        self.misses = ray_metrics.Counter(
            "kvturn_kv_misses",
            "Turns that could not reuse the decode engine's KV, by reason.",
            tag_keys=("mode", "reason"),
        )
        self.events = ray_metrics.Counter(
            "kvturn_turn_events",
            "The orchestration's event counters "
            "(pull_timeout, pull_short, decode_retried, drift_cut, spliced, ...).",
            tag_keys=("event",),
        )
        self.pull_timeouts = ray_metrics.Counter(
            "kvturn_pull_timeouts", "Prefill legs aborted past their pull deadline and recomputed."
        )
        self.placements = ray_metrics.Counter(
            "kvturn_placements",
            "Bidir turns by where the placement policy sent them (decode, prefill) and why "
            "(`app.turn.placement.Reason`: short, sooner, busy, itl, later, too_long, idle, no_replica).",
            tag_keys=("route", "reason"),
        )
        self.continuations = ray_metrics.Counter(
            "kvturn_decode_continuations",
            "Streamed answers continued on another decode replica after theirs failed mid-stream, "
            "by how (resumed, replayed_grammar, replayed_output) and the replica that failed.",
            tag_keys=("how", "replica"),
        )
        # Per tenant: the label is the tenant's namespace (a hash of its key), so the series
        # are bounded by the keys configured.
        self.tenant_turns = ray_metrics.Counter(
            "kvturn_tenant_turns", "Turns answered, per tenant.", tag_keys=("tenant",)
        )
        self.tenant_prompt_tokens = ray_metrics.Counter(
            "kvturn_tenant_prompt_tokens",
            "Prompt tokens of answered turns, per tenant.",
            tag_keys=("tenant",),
        )
        self.tenant_cached = ray_metrics.Counter(
            "kvturn_tenant_tokens_cached",
            "Prompt tokens not computed in their turn, per tenant.",
            tag_keys=("tenant",),
        )
        self.tenant_refusals = ray_metrics.Counter(
            "kvturn_tenant_refusals",
            "Turns refused with 429, per tenant and quota.",
            tag_keys=("tenant", "quota"),
        )
        self._refused: _Counts[tuple[str, str]] = _Counts()
        self._synced: _Counts[str] = _Counts()
        self.store = StoreGauges()
        self._task: asyncio.Task | None = None

    def ensure_polling(self, counts: Mapping[str, int], store_stats=None) -> None:
        """Start (once: a task of the running loop) exporting every `POLL_S` the growth of `counts`
        (the orchestration's counters: a failed turn reaches no `record_turn`) and, given
        `store_stats` (an async callable returning the store client's stats), the store's
        state. Called from the ingress's event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._poll(counts, store_stats), context=contextvars.Context()
            )

    async def _poll(self, counts, store_stats) -> None:
        while True:
            self.sync_events(counts)
            if store_stats is not None:
                try:
                    self.store.update(await store_stats())
                except Exception as exc:  # the store may restart: keep polling
                    logger.debug("store stats poll failed: %s", exc)
            await asyncio.sleep(POLL_S)

    def record_turn(self, result: Any, turn_index: int | None, tenant: str | None = None) -> None:
        """One finished turn (`app.turn.turns.TurnResult`) of `tenant` (its label)."""
        tags = {"mode": self._mode, "turn": turn_bucket(turn_index)}
        self.turns.inc(1, tags=tags)
        if tenant is not None:
            self.tenant_turns.inc(1, tags={"tenant": tenant})
            for counter, value in (
                (self.tenant_prompt_tokens, result.prompt_tokens),
                (self.tenant_cached, result.cached_tokens),
            ):
                if value > 0:
                    counter.inc(value, tags={"tenant": tenant})
        timings = result.timings or {}
        if "first_token_s" in timings:
            self.ttft.observe(timings["first_token_s"], tags=tags)
        for hop, seconds in turn_hops(timings).items():
            self.hops.observe(seconds, tags={"mode": self._mode, "hop": hop})
        # Ray's Counter.inc refuses values <= 0: a turn that reused nothing adds nothing.
        for counter, value in (
            (self.prompt_tokens, result.prompt_tokens),
            (self.pulled, result.reused_from_decode),
            (self.cached, result.cached_tokens),
            (self.computed, result.prompt_tokens - result.cached_tokens),
        ):
            if value > 0:
                counter.inc(value, tags=tags)
        if result.miss_reason:
            self.misses.inc(1, tags={"mode": self._mode, "reason": str(result.miss_reason)})

    def sync_refusals(self, refused: Mapping[tuple[str, str], int]) -> None:
        """Export the growth of the quotas' refusals (`app.api.quotas.Quotas.refused`)."""
        for (tenant, quota), value in list(refused.items()):
            grown = value - self._refused[(tenant, quota)]
            if grown > 0:
                self._refused[(tenant, quota)] = value
                self.tenant_refusals.inc(grown, tags={"tenant": tenant, "quota": quota})

    def sync_events(self, counts: Mapping[str, int]) -> None:
        """Export the growth of the orchestration's cumulative counters since the last call."""
        for event, value in list(counts.items()):
            grown = value - self._synced[event]
            if grown <= 0:
                continue
            self._synced[event] = value
            if event.startswith(CONTINUED_FROM):  # `app.turn.events.Continuation.of_replica`
                how, _, replica = event.removeprefix(CONTINUED_FROM).partition("/")
                self.continuations.inc(grown, tags={"how": how, "replica": replica})
                continue
            self.events.inc(grown, tags={"event": str(event)})
            if event == "pull_timeout":
                self.pull_timeouts.inc(grown)
            elif event.startswith(PLACED):  # `app.turn.events.TurnCount.PLACED_*`
                reason = Reason(event.removeprefix(PLACED))
                route = "decode" if reason in ON_DECODE else "prefill"
                self.placements.inc(grown, tags={"route": route, "reason": str(reason)})


class StoreGauges:
    """The handle store's state as gauges (set by `TurnMetrics`'s poll)."""

    def __init__(self) -> None:
        self.handles = ray_metrics.Gauge(
            "kvturn_store_handles", "Handles in the store by state.", tag_keys=("state",)
        )
        self.sessions = ray_metrics.Gauge("kvturn_store_sessions", "Conversations the store keeps.")
        self.claimed = ray_metrics.Gauge(
            "kvturn_store_claimed_handles", "Handles claimed by a turn in flight."
        )
        self.pinned = ray_metrics.Gauge(
            "kvturn_store_pinned_blocks",
            "Decode blocks the store counts as pinned, per engine.",
            tag_keys=("engine",),
        )
        self.exits = ray_metrics.Gauge(
            "kvturn_store_handle_exits",
            "Handles that left the store, by exit, and stored-response events (responses_*; cumulative).",
            tag_keys=("exit",),
        )
        self.tenant = ray_metrics.Gauge(
            "kvturn_store_tenant",
            "Per tenant: sessions kept, blocks pinned, evictions "
            "(for blocks, for its session limit; cumulative).",
            tag_keys=("tenant", "figure"),
        )
        self._seen_states: set[str] = set()

    def update(self, store_stats: Mapping[str, Any]) -> None:
        """Set the gauges from `StoreClient.stats()` (`{"shards": [HandleStore.stats(), ...]}`)."""
        shards = store_stats.get("shards") or [store_stats]
        states: _Counts[str] = _Counts()
        exits: _Counts[str] = _Counts()
        pinned: _Counts[str] = _Counts()
        sessions = claimed = 0
        for shard in shards:
            states.update(shard.get("handles") or {})
            for counts in (shard.get("counts"), (shard.get("responses") or {}).get("counts")):
                exits.update({k: v for k, v in (counts or {}).items() if isinstance(v, (int, float))})
            pinned.update(shard.get("pinned_blocks") or {})
            sessions += int(shard.get("sessions") or 0)
            claimed += int(shard.get("claimed_handles") or 0)
        for state in self._seen_states | set(states):
            self.handles.set(states.get(state, 0), tags={"state": state})
        self._seen_states |= set(states)
        for name, value in exits.items():
            self.exits.set(value, tags={"exit": name})
        for engine, blocks in pinned.items():
            self.pinned.set(blocks, tags={"engine": engine})
        tenants: dict[str, _Counts[str]] = {}
        for shard in shards:
            for tenant, figures in (shard.get("tenants") or {}).items():
                tenants.setdefault(tenant.rstrip(":") or "default", _Counts()).update(figures)
        for tenant, figures in tenants.items():
            for figure, value in figures.items():
                self.tenant.set(value, tags={"tenant": tenant, "figure": figure})
        self.sessions.set(sessions)
        self.claimed.set(claimed)


class TimedStore:
    """Wraps a store client: every store operation (`connector.store_api.StoreOp`) is
    timed into `kvturn_store_op_seconds` (tagged by operation), and failed calls are
    counted. Other attributes pass through."""

    OPS = frozenset(op.value for op in StoreOp)

    def __init__(self, store):
        self._store = store
        self._latency = ray_metrics.Histogram(
            "kvturn_store_op_seconds",
            "Latency of handle-store calls seen by the ingress.",
            boundaries=STORE_BOUNDARIES,
            tag_keys=("op",),
        )
        self._errors = ray_metrics.Counter(
            "kvturn_store_op_errors", "Handle-store calls that failed.", tag_keys=("op",)
        )

    def __getattr__(self, name: str):
        target = getattr(self._store, name)
        if name not in self.OPS:
            return target

        async def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await target(*args, **kwargs)
            except BaseException:
                self._errors.inc(1, tags={"op": name})
                raise
            finally:
                self._latency.observe(time.perf_counter() - started, tags={"op": name})

        return timed


class EngineMetrics:
    """One engine's metrics, fed by vLLM's stat-logger hook (`record_step`, once per
    engine step in the replica's process; cheap, never blocks)."""

    def __init__(self, role: str, engine_id: str):
        self._tags = {"role": role, "engine": engine_id}
        role_tags = ("role", "engine")
        self.blocks_in_use = ray_metrics.Gauge(
            "kvturn_engine_kv_blocks_in_use",
            "KV blocks in use: running requests plus blocks held for transfer "
            "(with nothing running: the pinned blocks).",
            tag_keys=role_tags,
        )
        self.blocks_total = ray_metrics.Gauge(
            "kvturn_engine_kv_blocks", "KV blocks of the engine's cache.", tag_keys=role_tags
        )
        self.running = ray_metrics.Gauge(
            "kvturn_engine_running_requests", "Requests the engine is running.", tag_keys=role_tags
        )
        self.transfers = ray_metrics.Counter(
            "kvturn_nixl_transfers", "NIXL reads this engine made.", tag_keys=role_tags
        )
        self.transfer_bytes = ray_metrics.Counter(
            "kvturn_nixl_transfer_bytes", "Bytes this engine read over NIXL.", tag_keys=role_tags
        )
        self.transfer_seconds = ray_metrics.Counter(
            "kvturn_nixl_transfer_seconds", "Seconds this engine's NIXL reads took.", tag_keys=role_tags
        )
        self.failed_transfers = ray_metrics.Counter(
            "kvturn_nixl_failed_transfers", "NIXL reads that failed.", tag_keys=role_tags
        )

    def record_step(
        self, *, kv_cache_usage: float, num_blocks: int | None, running: int, transfer_stats: Mapping | None
    ) -> None:
        """One scheduler step's stats: `kv_cache_usage` is the fraction of blocks in use,
        `transfer_stats` the NixlConnector's stats of the step (or None)."""
        if num_blocks:
            self.blocks_total.set(num_blocks, tags=self._tags)
            self.blocks_in_use.set(round(kv_cache_usage * num_blocks), tags=self._tags)
        self.running.set(running, tags=self._tags)
        if not isinstance(transfer_stats, Mapping):
            return
        durations = transfer_stats.get("transfer_duration") or []
        if durations:
            self.transfers.inc(len(durations), tags=self._tags)
            self.transfer_seconds.inc(float(sum(durations)), tags=self._tags)
        sent = int(sum(transfer_stats.get("bytes_transferred") or []))
        if sent:
            self.transfer_bytes.inc(sent, tags=self._tags)
        failed = len(transfer_stats.get("num_failed_transfers") or [])
        if failed:
            self.failed_transfers.inc(failed, tags=self._tags)
