"""`app.fleet.autoscaling`: the roles' policies on Serve's policy API, and the build options."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.config import AppConfig
from app.fleet.autoscaling import KV_IN_USE, QUEUED_TOKENS, PoolTotalPolicy


def ctx(metric: str | None, values: list[float], current: int = 2):
    metrics = {metric: {f"r{i}": v for i, v in enumerate(values)}} if metric else {}
    return SimpleNamespace(
        aggregated_metrics=metrics, target_num_replicas=current, current_num_replicas=current
    )


@pytest.mark.parametrize(
    ("in_use", "replicas"),
    [
        ([0.9], 2),  # one replica at 90% of its blocks, target 70%: a second one
        ([0.5], 1),
        ([0.8, 0.8], 3),  # 1.6 replicas' worth at 70% each
        ([0.3, 0.2], 1),  # half a replica's worth: one replica holds it under the target
        ([0.0, 0.0, 0.0], 0),  # Serve's min_replicas keeps at least one
    ],
)
def test_decode_keeps_the_pools_kv_in_use_at_the_target(in_use, replicas):
    desired, state = PoolTotalPolicy(KV_IN_USE, target=0.7)(ctx(KV_IN_USE, in_use, current=len(in_use)))
    assert math.ceil(round(desired, 6)) == replicas
    assert state["kv_in_use"] == pytest.approx(sum(in_use))


def test_a_pool_that_reported_nothing_stays_as_it_is():
    assert PoolTotalPolicy(KV_IN_USE, target=0.7)(ctx(None, [], current=3)) == (3, {})
    assert PoolTotalPolicy(QUEUED_TOKENS, target=1000)(ctx(None, [], current=2)) == (2, {})


@pytest.mark.parametrize(("queued", "replicas"), [([5000.0], 3), ([1000.0, 500.0], 1), ([0.0, 0.0], 0)])
def test_prefill_keeps_the_tokens_in_flight_per_replica_at_the_target(queued, replicas):
    policy = PoolTotalPolicy(QUEUED_TOKENS, target=2048)
    desired, state = policy(ctx(QUEUED_TOKENS, queued, current=len(queued)))
    assert math.ceil(desired) == replicas
    assert state["queued_tokens"] == round(sum(queued))


def _options(app, name: str):
    from ray.serve.deployment import Application

    todo = [app]
    while todo:
        node = todo.pop()._bound_deployment
        if node.name == name:
            return node
        todo += [a for a in (*node.init_args, *node.init_kwargs.values()) if isinstance(a, Application)]
    raise KeyError(name)


def test_an_autoscaled_role_gets_serves_config_with_the_apps_policy(tmp_path):
    from app.builder import build

    tree = {
        "model": str(tmp_path),
        "decode": {
            "num_replicas": 2,
            "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_kv_in_use": 0.6},
        },
        "prefill": {"autoscaling": {"max_replicas": 2, "target_queued_tokens": 4096, "upscale_delay_s": 1}},
    }
    graph = build(AppConfig.model_validate(tree))
    decode = _options(graph, "DecodeServer")._deployment_config.autoscaling_config
    assert (decode.min_replicas, decode.initial_replicas, decode.max_replicas) == (1, 2, 3)
    assert decode.policy.policy_function == "app.fleet.autoscaling:PoolTotalPolicy"
    assert decode.policy.policy_kwargs == {"metric": "kv_in_use", "target": 0.6}
    prefill = _options(graph, "PrefillServer")._deployment_config.autoscaling_config
    assert prefill.policy.policy_kwargs == {"metric": "queued_tokens", "target": 4096}
    assert prefill.upscale_delay_s == 1
    # The bounds and targets are options, not constructor arguments: changing them
    # restarts nothing.
    assert _options(graph, "DecodeServer").init_args[0].decode.autoscaling is None


def test_autoscaling_bounds_are_checked(tmp_path):
    with pytest.raises(ValidationError, match="min_replicas"):
        AppConfig.model_validate(
            {"model": str(tmp_path), "decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}
        )
