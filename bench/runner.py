"""Runs the workload: deploys each mode in turn on a local Ray cluster, or drives an
already running deployment (`--url`).

Per mode: deploy (`serve.run`), wait for `/health`, warm up with a separate short
workload (engines and NIXL connections start lazily), read the engines' counters, run
the measured workload, read the counters again, delete the app and wait until its
engine processes are gone. Modes run one at a time, so they never share the machine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.apis import Api
from bench.client import kv_stats, run_workload, served_model, wait_healthy
from bench.deploy import LocalCluster, deployed, replica_ids
from bench.profiles import Profile
from bench.record import TurnRecord
from bench.workload import Workload

COUNTERS = (
    "prompt_tokens_total",
    "prompt_tokens_computed",
    "prompt_tokens_local_hit",
    "prompt_tokens_external",
    "requests",
    "kv_transfers",
    "kv_transfer_s",
    "kv_transfer_bytes",
    "kv_failed_transfers",
    "engine_busy_steps",
    "engine_busy_step_s",
    "engine_prompt_steps",
    "engine_prompt_step_s",
    "engine_busy_step_seqs",
)


@dataclass
class ModeRun:
    """What one mode produced."""

    mode: str
    label: str
    records: list[TurnRecord]
    wall_s: float
    api: Api = Api.CHAT
    """The API every session spoke (warm-up included)."""
    deploy_s: float | None = None
    warmup_s: float | None = None
    engines: dict[str, dict[str, int]] = field(default_factory=dict)
    """Counter deltas over the measured phase, per role ('prefill', 'decode')."""
    kv_stats: dict[str, Any] | None = None
    """Difference of the ingress's `/v1/kv/stats` turn counters over the measured phase."""


# -- engine counters ---------------------------------------------------------------------


def engine_counters(app: str, deployment: str) -> dict[str, Any] | None:
    """Counters summed over the deployment's replicas that answer (None: no deployment)."""
    from ray import serve

    from app.engines.wire import ReplicaQuery

    try:
        handle = serve.get_deployment_handle(deployment, app)
    except Exception:
        return None
    seen: dict[str, dict] = {}
    rids: Sequence[str | None] = replica_ids(app, deployment) or [None]
    for rid in rids:
        try:
            stats = handle.stats.remote(ReplicaQuery(rid)).result(timeout_s=60)
        except Exception:
            continue
        seen[stats["replica_id"]] = stats
    if not seen:
        return None
    total = {k: sum(s.get(k, 0) for s in seen.values()) for k in COUNTERS}
    total["replicas"] = len(seen)
    return total


def counter_delta(after: dict | None, before: dict | None) -> dict[str, int] | None:
    """The `COUNTERS` an engine role added from `before` to `after` (`engine_counters`)."""
    if after is None:
        return None
    before = before or {}
    out = {k: after[k] - before.get(k, 0) for k in COUNTERS}
    out["replicas"] = after.get("replicas", 0)
    return out


def _turn_counts_delta(after: dict | None, before: dict | None) -> dict | None:
    if not after or "turns" not in after:
        return None
    prev = (before or {}).get("turns", {})
    return {k: v - prev.get(k, 0) for k, v in after["turns"].items() if v - prev.get(k, 0)}


# -- runs --------------------------------------------------------------------------------


def _measure(
    url: str, model: str, workload: Workload, label: str, on_turn, api: Api
) -> tuple[list[TurnRecord], float]:
    prefix = f"bench-{label}-{uuid.uuid4().hex[:8]}"
    return asyncio.run(run_workload(url, model, workload, session_prefix=prefix, on_turn=on_turn, api=api))


def run_url(
    url: str,
    label: str,
    workload: Workload,
    warmup: Workload | None,
    on_turn,
    log,
    api: Api = Api.CHAT,
) -> ModeRun:
    """Benchmark a deployment that is already serving at `url` (no deploy, no engine
    counters: only the ingress's turn counters from `/v1/kv/stats`)."""
    url = url.rstrip("/")
    asyncio.run(wait_healthy(url, 60))
    model = asyncio.run(served_model(url))
    log(f"[{label}] serving {model} at {url}, sessions speak {api.value}")
    warmup_s = None
    if warmup is not None:
        t = time.perf_counter()
        _measure(url, model, warmup, label + "-warmup", lambda r: None, api)
        warmup_s = time.perf_counter() - t
    before = asyncio.run(kv_stats(url))
    records, wall = _measure(url, model, workload, label, on_turn, api)
    after = asyncio.run(kv_stats(url))
    return ModeRun(
        mode=label,
        label=label,
        records=records,
        wall_s=wall,
        api=api,
        warmup_s=warmup_s,
        kv_stats=_turn_counts_delta(after, before),
    )


def run_mode(
    cluster: LocalCluster,
    profile: Profile,
    mode: str,
    model_path: str,
    workload: Workload,
    warmup: Workload | None,
    on_turn: Callable[[TurnRecord], None],
    log: Callable[[str], None],
    api: Api = Api.CHAT,
) -> ModeRun:
    app_name = f"bench-{mode}"
    cfg = profile.app_config(mode, model_path, app_name)
    shape = "P/D" if cfg.disaggregated else f"{cfg.decode.num_replicas} engine(s), no P/D"
    log(f"[{mode}] deploying {cfg.model_name} ({shape})")
    with deployed(cfg, cluster=cluster, name=app_name, engines_gone_s=90.0, log=log, label=mode) as dep:
        url, deploy_s = dep.url, dep.deploy_s
        log(f"[{mode}] running after {deploy_s:.0f} s ({len(dep.engines)} engine processes)")
        model = asyncio.run(served_model(url))
        warmup_s = None
        if warmup is not None:
            t = time.perf_counter()
            _measure(url, model, warmup, mode + "-warmup", lambda r: None, api)
            warmup_s = time.perf_counter() - t
        time.sleep(1.0)  # engine stats are recorded after each step's outputs
        roles: tuple[tuple[str, str], ...] = (("prefill", "PrefillServer"),) if cfg.disaggregated else ()
        roles += (("decode", "DecodeServer"),)
        before = {role: engine_counters(app_name, d) for role, d in roles}
        kv_before = asyncio.run(kv_stats(url))
        records, wall = _measure(url, model, workload, mode, on_turn, api)
        time.sleep(1.0)
        after = {role: engine_counters(app_name, d) for role, d in roles}
        kv_after = asyncio.run(kv_stats(url))
    engines = {role: d for role in after if (d := counter_delta(after[role], before[role])) is not None}
    return ModeRun(
        mode=mode,
        label=mode,
        records=records,
        wall_s=wall,
        api=api,
        deploy_s=deploy_s,
        warmup_s=warmup_s,
        engines=engines,
        kv_stats=_turn_counts_delta(kv_after, kv_before),
    )


def resolve_model(profile: Profile) -> str:
    """A model path or id the app accepts; builds the benchmark models when needed."""
    from app.config import OPEN_MODEL
    from bench.models import SHAPES, ensure_model, ensure_tokenizer_source

    if profile.model in SHAPES:
        return str(ensure_model(profile.model))
    if Path(profile.model).expanduser().resolve() == OPEN_MODEL.resolve():
        return str(ensure_tokenizer_source())
    return profile.model
