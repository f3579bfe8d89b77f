"""The session-affinity request router's choice of replicas (`app.routing`), on stand-ins
of Serve's running replicas: no Ray cluster."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.routing import SessionAffinityRouter
from app.wire import EngineRequest, Sampling


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
