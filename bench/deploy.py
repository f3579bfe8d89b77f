"""Deploying the app for a benchmark, the one way every benchmark does it.

`deployed(cfg, ...)` is a `with` block around one app: on a Ray cluster of this
process's own (`LocalCluster`, started for the block unless one is passed in, with Serve's
HTTP proxy on 127.0.0.1:`port`), Serve runs `app.builder.build(cfg)`, `/health` is
awaited, and the block gets a `Deployment` (its URL, how long it took, its engine
processes). At the end the app is deleted (a passed-in cluster) or Serve and Ray are shut
down (an own one), and, if asked (`engines_gone_s`), its engine processes are awaited.

Also what the benchmarks read of the processes and actors behind an app: vLLM engine
processes (`engine_pids`), a deployment's Serve replica ids (`replica_ids`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.client import wait_healthy

ENGINE_PROCESS = "VLLM::EngineCore"


class LocalCluster:
    """A Ray cluster of this process's own (never an existing one) with Serve's HTTP
    proxy on 127.0.0.1:`port`. `env` is set in this process's environment first (the
    Ray workers it starts, engine replicas included, inherit it); `metrics_port` is Ray's
    metrics export port (Ray's choice when None)."""

    def __init__(
        self,
        port: int,
        env: dict[str, str] | None = None,
        num_cpus: int = 8,
        *,
        metrics_port: int | None = None,
        namespace: str | None = "kvturn-bench",
    ):
        self.port = port
        self.env = dict(env or {})
        self.num_cpus = num_cpus
        self.metrics_port = metrics_port
        self.namespace = namespace

    def __enter__(self) -> LocalCluster:
        import ray
        from ray import serve

        for key, value in self.env.items():
            os.environ[key] = value
        extra: dict[str, Any] = {}
        if self.metrics_port is not None:
            extra["_metrics_export_port"] = self.metrics_port
        ray.init(
            address="local",
            num_cpus=self.num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            namespace=self.namespace,
            **extra,
        )
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@dataclass
class Deployment:
    """An app `deployed` runs."""

    url: str
    app: str
    cluster: LocalCluster
    deploy_s: float = 0.0
    """From `serve.run` to the first 200 of `/health`."""
    engines: set[int] = field(default_factory=set)
    """The engine processes that appeared with the app (by the time it was healthy)."""
    left_over: set[int] | None = None
    """After the block, with `engines_gone_s`: the app's engine processes still alive."""


@contextmanager
def deployed(
    cfg,
    *,
    cluster: LocalCluster | None = None,
    port: int = 8300,
    env: dict[str, str] | None = None,
    num_cpus: int = 8,
    metrics_port: int | None = None,
    namespace: str | None = "kvturn-bench",
    name: str | None = None,
    health_timeout_s: float = 120.0,
    engines_gone_s: float | None = None,
    log: Callable[[str], None] | None = None,
    label: str | None = None,
) -> Iterator[Deployment]:
    """Deploy `app.builder.build(cfg)` as Serve app `name` (default: `cfg.app_name`) at
    route `/` on `cluster`, or on a `LocalCluster(port, env, num_cpus, metrics_port=...,
    namespace=...)` started for the block; yield it once `/health` answers (within
    `health_timeout_s`). At the end: delete the app (or shut the own cluster down); with
    `engines_gone_s`, wait that long for its engine processes to end and keep those that
    did not in `left_over` (named by `log`, as `[label]`, if given)."""
    from ray import serve

    from app.builder import build

    name = name or cfg.app_name
    with ExitStack() as stack:
        own = cluster is None
        if cluster is None:
            cluster = stack.enter_context(
                LocalCluster(port, env, num_cpus, metrics_port=metrics_port, namespace=namespace)
            )
        foreign = engine_pids()
        started = time.perf_counter()
        serve.run(build(cfg), name=name, route_prefix="/")
        dep = Deployment(cluster.url, name, cluster)
        try:
            asyncio.run(wait_healthy(dep.url, health_timeout_s))
            dep.deploy_s = time.perf_counter() - started
            dep.engines = engine_pids() - foreign
            yield dep
        finally:
            # An own cluster's engines descend from this process (taken before its shutdown
            # orphans them); on a shared one, every engine that came with the app.
            ours = dep.engines | (engine_pids(os.getpid() if own else None) - foreign)
            if own:
                stack.close()  # serve.shutdown() and ray.shutdown()
            else:
                serve.delete(name)
            if engines_gone_s is not None:
                wait_engines_gone(ours, engines_gone_s)
                dep.left_over = ours & engine_pids()
                if dep.left_over and log is not None:
                    log(
                        f"[{label or name}] warning: engine processes {sorted(dep.left_over)} "
                        "still alive after delete"
                    )


# -- processes and replicas --------------------------------------------------------------


def engine_pids(within: int | None = None) -> set[int]:
    """Ids of the vLLM engine processes on this machine; with `within`, only those that
    descend from that process (a driver's own local Ray cluster: its raylet is the
    driver's child, and the engines the raylet's workers' children), not another run's."""
    import psutil

    pids = set()
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            names = [p.info.get("name") or ""] + list(p.info.get("cmdline") or [])
            if not any(ENGINE_PROCESS in n for n in names):
                continue
            if within is None or any(a.pid == within for a in p.parents()):
                pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def wait_engines_gone(ours: set[int], timeout_s: float = 90.0) -> bool:
    """Wait up to `timeout_s` for the processes `ours` to end; True if they did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (ours & engine_pids()):
            return True
        time.sleep(1.0)
    return False


def replica_ids(app: str, deployment: str) -> list[str]:
    """Serve replica ids of a deployment, from the names of its live actors."""
    import ray

    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception:
        return []
    ids = []
    for actor in actors:
        name = actor.get("name") if isinstance(actor, dict) else actor
        # SERVE_REPLICA::<app>#<deployment>#<replica id>
        if name and name.startswith("SERVE_REPLICA::"):
            parts = name.removeprefix("SERVE_REPLICA::").split("#")
            if len(parts) == 3 and parts[0] == app and parts[1] == deployment:
                ids.append(parts[2])
    return ids
