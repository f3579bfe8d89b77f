"""Shared fixtures. End-to-end tests share one Ray cluster and two Serve apps per run:

* `pd`: the product (bidir mode): 1 prefill replica, 2 decode replicas, real vLLM CPU
  engines, real NIXL over UCX on loopback. Prefill's own prefix cache is off, so every
  reused history token on prefill is a token pulled from decode, and the counts prove it.
* `ref`: one plain engine (single mode) that recomputes, for token-for-token comparison.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "tiny-qwen3"
PD_PORT = 8123
# Not 8124: the two-node test's Serve proxy listens there.
METRICS_PORT = int(os.environ.get("KVTURN_TEST_METRICS_PORT", "8129"))


def pytest_collection_modifyitems(config, items):
    """Mark the engine tests, and run the tests on the shared cluster (`ray_cluster`, and
    the `apps` on it) last, the `apps` ones at the very end: the tests that start Ray
    clusters of their own (two nodes, lifetime, the benchmark) then never run beside the
    shared cluster or its idle engines on this small machine."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.e2e)

    def order(item) -> tuple[bool, bool]:
        fixtures = getattr(item, "fixturenames", ())
        return "ray_cluster" in fixtures, "apps" in fixtures

    items.sort(key=order)


def config_with(tree: dict, overrides: dict):
    """`AppConfig` of `tree` with dotted-key `overrides` (`"decode.num_replicas": 1`) set over
    it, built as the app builds it from `serve run` arguments (`AppConfig.from_args`)."""
    from app.config import AppConfig

    return AppConfig.from_args({**tree, **overrides})


def pd_config(**overrides):
    tree = {
        "mode": "bidir",
        "model": str(MODEL),
        "enforce_eager": True,
        "max_model_len": 2048,
        "default_max_tokens": 16,
        "prefill": {"num_cpus": 0.5, "enable_prefix_caching": False, "kv_cache_memory_bytes": 128 << 20},
        "decode": {"num_cpus": 0.5, "num_replicas": 2, "kv_cache_memory_bytes": 128 << 20},
        # Every turn through prefill (it pulls the history): the path these tests prove.
        # tests/e2e/test_decode_local.py turns decode-local turns on in an app of its own.
        "transfer": {
            "recompute_threshold_tokens": 32,
            "decode_local_tokens": 0,
            "decode_local_busy_tokens": 0,
            "kv_buffer_device": "cpu",
            "decoder_kv_blocks_ttl_s": 40,
            "pull_timeout_s": 15,
            "prefill_timeout_s": 30,
        },
        # Short lifetimes so the expiry and clean-up tests need not wait long.
        "sessions": {"handle_ttl_s": 25},
        # vLLM's Qwen3 reasoning parser; thinking off unless a request turns it on.
        "openai": {"reasoning_parser": "qwen3", "chat_template_kwargs": {"enable_thinking": False}},
        "app_name": "pd",
    }
    return config_with(tree, overrides)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # address="local": always a fresh cluster, never one another test left registered.
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        namespace="kvturn-tests",
        # Prometheus metrics of the node (tests/e2e/test_metrics.py scrapes them).
        _metrics_export_port=METRICS_PORT,
    )
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def apps(ray_cluster):
    """Deploy `pd` and `ref` once for the whole run (engines start in parallel)."""
    from ray import serve
    from ray.serve.api import RunTarget

    from app.builder import build
    from app.config import Mode

    serve.start(http_options={"host": "127.0.0.1", "port": PD_PORT})
    started = time.monotonic()
    pd = pd_config()
    ref = pd_config(mode=Mode.SINGLE.value, app_name="ref", **{"decode.num_replicas": 1})
    # Both apps deploy at once (engines start in parallel); returns when both run.
    serve.run_many(
        [
            RunTarget(target=build(pd), name="pd", route_prefix="/"),
            RunTarget(target=build(ref), name="ref", route_prefix="/ref"),
        ],
        wait_for_applications_running=True,
    )
    print(f"\napps running after {time.monotonic() - started:.0f} s")
    yield {"pd": pd, "ref": ref, "url": f"http://127.0.0.1:{PD_PORT}"}
