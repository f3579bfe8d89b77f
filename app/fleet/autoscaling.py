"""Autoscaling of the engine roles on Ray Serve's public policy API, on the app's signals.

Each replica reports one figure (Serve calls its `record_autoscaling_stats` every
`metrics_interval_s`; Serve averages it over `look_back_period_s`):

    decode   `kv_in_use`: the share of its engine's KV blocks in use, running requests and
             the conversations pinned for their next turn (the engine's own block pool)
    prefill  `queued_tokens`: new prompt tokens in its legs in flight (prompt less the
             history a leg pulls), the work standing between a turn and its first token

and each role's policy turns the pool's total into a replica count: decode keeps the
pool's KV in use at `target_kv_in_use` (a new replica takes new sessions at once, and
rebalanced conversations, `app.fleet.drain.Rebalance`; a replica removed drains its
conversations to the others, `app.fleet.drain.Drain`); prefill keeps `target_queued_tokens` in
flight per replica. Serve applies `min_replicas`/`max_replicas` and the up/down delays.
Replicas not reporting yet (starting) count as empty.

`serve_autoscaling_config` builds Serve's config for a role; `check_serve_autoscaling`
fails the build on a Ray whose Serve lacks the API (checked, not assumed).
"""

from __future__ import annotations

import logging
from typing import Any

from app.config import AutoscalingRoleConfig

logger = logging.getLogger("ray.serve").getChild(__name__)

KV_IN_USE = "kv_in_use"
QUEUED_TOKENS = "queued_tokens"


class PoolTotalPolicy:
    """Replicas for the pool's total of one per-replica metric, `target` a replica: decode
    on `kv_in_use` (blocks in use, in replicas' worth), prefill on `queued_tokens`. Serve
    instantiates it once per deployment with `policy_kwargs`."""

    def __init__(self, metric: str, target: float):
        self.metric = metric
        self.target = target

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        # Per replica, averaged by Serve over the look-back window.
        reported = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        if not reported:  # nothing reported yet: stay
            return ctx.target_num_replicas, {}
        total = sum(reported.values())
        return total / self.target, {self.metric: round(total, 4)}


def check_serve_autoscaling() -> None:
    """Raise if this Ray's Serve lacks what the policies use: custom policies with kwargs
    (`AutoscalingPolicy.policy_kwargs`), per-replica custom metrics
    (`AutoscalingContext.aggregated_metrics`, fed by `record_autoscaling_stats`)."""
    try:
        from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
    except ImportError as exc:
        raise RuntimeError(f"this Ray's Serve has no autoscaling policy API: {exc}") from None
    missing = [
        name
        for name, ok in (
            ("AutoscalingPolicy.policy_kwargs", "policy_kwargs" in AutoscalingPolicy.model_fields),
            ("AutoscalingConfig.policy", "policy" in AutoscalingConfig.model_fields),
            ("AutoscalingContext.aggregated_metrics", hasattr(AutoscalingContext, "aggregated_metrics")),
        )
        if not ok
    ]
    if missing:
        raise RuntimeError(f"this Ray's Serve lacks {', '.join(missing)}: role autoscaling needs them")


def serve_autoscaling_config(role: str, cfg: AutoscalingRoleConfig, initial_replicas: int) -> dict[str, Any]:
    """Serve's `autoscaling_config` for `role` ("decode" or "prefill")."""
    check_serve_autoscaling()
    from ray.serve.config import AutoscalingPolicy

    metric, target = (
        (KV_IN_USE, cfg.target_kv_in_use) if role == "decode" else (QUEUED_TOKENS, cfg.target_queued_tokens)
    )
    policy = AutoscalingPolicy(
        policy_function="app.fleet.autoscaling:PoolTotalPolicy",
        policy_kwargs={"metric": metric, "target": target},
    )
    return {
        "min_replicas": cfg.min_replicas,
        "max_replicas": cfg.max_replicas,
        "initial_replicas": min(max(initial_replicas, cfg.min_replicas), cfg.max_replicas),
        "upscale_delay_s": cfg.upscale_delay_s,
        "downscale_delay_s": cfg.downscale_delay_s,
        "metrics_interval_s": cfg.metrics_interval_s,
        "look_back_period_s": cfg.look_back_period_s,
        "policy": policy,
    }
