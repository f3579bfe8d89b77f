"""The session-affinity request router's choice of replicas (`app.fleet.routing`), on stand-ins
of Serve's running replicas: no Ray cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.engines.wire import EngineRequest, Sampling
from app.fleet.routing import SessionAffinityRouter


def replicas(*ids: str) -> list:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ids]


def choose(candidates, request: EngineRequest) -> list[list[str]]:
    router = SessionAffinityRouter.__new__(SessionAffinityRouter)
    ranks = asyncio.run(router.choose_replicas(candidates, SimpleNamespace(args=(request,))))
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def request(**kw) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=(1, 2), sampling=Sampling(max_tokens=1), **kw)


def test_the_sessions_replica_is_tried_first():
    assert choose(replicas("a", "b", "c"), request(preferred_replica="b")) == [["b"], ["a", "c"]]


def test_a_retry_leaves_out_the_replicas_that_failed_it():
    assert choose(replicas("a", "b", "c"), request(avoid_replicas=("a", "b"))) == [["c"]]
    assert choose(replicas("a", "b"), request(avoid_replicas=("a",))) == [["b"]]


def test_a_retry_with_no_other_replica_left_tries_the_failed_ones():
    assert choose(replicas("a"), request(avoid_replicas=("a",))) == [["a"]]


def test_liveness_reaches_the_ingress_through_the_router_serve_ships(tmp_path):
    """Serve pickles a custom router class by value (`RequestRouterConfig`): in the
    ingress's process the router is a copy whose module globals are copies too. What it
    records about running and dead replicas must still land in the table the ingress
    reads (`LiveReplicas`); a router writing to its own copy left every replica's
    liveness unknown. Checked in a fresh interpreter, as in the ingress."""
    import subprocess
    import sys

    from ray.serve.config import RequestRouterConfig

    shipped = RequestRouterConfig(request_router_class="app.fleet.routing.SessionAffinityRouter")
    (tmp_path / "router.pkl").write_bytes(shipped.get_serialized_request_router_cls())
    script = """
import sys
from types import SimpleNamespace
from ray import cloudpickle
from app.fleet.routing import LiveReplicas, SessionAffinityRouter
shipped = cloudpickle.loads(open(sys.argv[1], "rb").read())
assert shipped is not SessionAffinityRouter, "not a by-value copy"
base = shipped.__mro__[1]
base.update_replicas = lambda self, replicas: None  # Serve's own bookkeeping
base.on_replica_actor_died = lambda self, replica_id: None
base.app_name = property(lambda self: self._deployment_id.app_name)
router = shipped.__new__(shipped)
router._deployment_id = SimpleNamespace(name="DecodeServer", app_name="app1")
replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ("a", "b")]
live = LiveReplicas("app1", "DecodeServer")
print(live.running())
router.update_replicas(replicas)
print(sorted(live.running()), live.alive("a"))
router.on_replica_actor_died(SimpleNamespace(unique_id="a"))
print(sorted(live.running()), live.alive("a"))
"""
    command = [sys.executable, "-c", script, str(tmp_path / "router.pkl")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-3:] == ["None", "['a', 'b'] True", "['b'] False"]
