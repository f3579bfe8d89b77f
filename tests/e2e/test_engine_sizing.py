"""Engines sized by the app, read back from the engines' own worker processes.

vLLM's default on CPU is an OpenMP team over every core, bound to the same cores in every
engine of the node. The app gives each engine the threads of its replica's CPU share
instead: the test cluster advertises 8 CPUs over this machine's cores and each engine
replica holds 0.5 of them, so every engine must run exactly one unbound thread. Unbound
means the thread that runs the model may use every core, in the engines with the
NixlConnector too (vLLM's NIXL worker pins it to the node's last core, the same one in
every engine, unless the app's plugin keeps it).
"""

from __future__ import annotations

import os

from ray import serve

from app.engines.sizing import share_threads
from app.engines.wire import ReplicaQuery


def _engines(app: str, deployment: str, replicas: int):
    handle = serve.get_deployment_handle(deployment, app)
    seen = {}
    for _ in range(8 * replicas):
        stats = handle.stats.remote(ReplicaQuery()).result()
        seen[stats["replica_id"]] = stats
        if len(seen) == replicas:
            break
    assert len(seen) == replicas, seen
    return handle, seen


def test_every_engine_runs_the_threads_the_app_sized(apps):
    cores = len(os.sched_getaffinity(0))
    expected = share_threads(replica_cpus=0.5, node_cpu_resource=8, node_cores=cores)
    assert expected == max(1, cores // 16)
    roles = [("pd", "PrefillServer", 1), ("pd", "DecodeServer", 2), ("ref", "DecodeServer", 1)]
    total = 0
    for app, deployment, replicas in roles:
        handle, engines = _engines(app, deployment, replicas)
        for replica_id, stats in engines.items():
            assert stats["cpu_threads"] == expected and stats["cpu_binding"] == "nobind", stats
            in_use = handle.cpu_in_use.remote(ReplicaQuery(replica_id)).result()
            assert in_use == {"threads": expected, "cores": sorted(os.sched_getaffinity(0))}, (
                app,
                deployment,
                replica_id,
                in_use,
            )
            total += in_use["threads"]
    # vLLM's own default would give each of the 4 engines every core.
    assert total == 4 * expected < 4 * cores or cores == 1
