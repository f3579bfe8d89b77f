"""How many CPU threads an engine replica runs, and where they may run.

vLLM's CPU build gives every engine an OpenMP team over all the cores it can see and binds
it to them. Two engines on one node (prefill and decode, the usual P/D layout) then fight
over the same cores and each step of both slows by an order of magnitude. The app sizes
every engine itself instead, from what Ray gave its replica:

    threads = cpu_threads, if the role sets it
            = max(1, floor(cores of the node x this replica's CPU share of the node)) otherwise

where the CPU share is the replica's `num_cpus` over the node's `CPU` resource: Ray never
places more engine replicas on a node than its CPU resource allows, so the engines of a
node never ask for more threads than it has cores (unless the node advertises more CPUs
than cores, as test clusters do; then each gets one thread).

Binding (`cpu_binding`):
    nobind     threads float over the node's cores (default; best where other processes,
               such as Ray's and the ingress, share the node)
    exclusive  each engine takes its own cores from a node-local registry and binds its
               threads there; an engine that finds too few free cores runs unbound
    vllm       vLLM's automatic binding (every engine on the same NUMA node's cores)

Called once per engine replica, in the replica's process, before the engine starts; the
result goes into the environment the engine's processes inherit. On GPU the same sizing
bounds the host threads of each engine; accelerator memory is sized per role with
`kv_cache_memory_bytes` / `engine_kwargs.gpu_memory_utilization` (see docs/configuration.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from app.engines.registry import NodeRegistry

Binding = Literal["nobind", "exclusive", "vllm"]

_CORE_REGISTRY = NodeRegistry("/tmp/kvturn-engine-cores")


@dataclass(frozen=True)
class CpuPlan:
    """Threads and binding of one engine."""

    threads: int
    bind: str
    """VLLM_CPU_OMP_THREADS_BIND: 'nobind', 'auto' (vLLM's own) or a core list like '2,3'."""

    def env(self) -> dict[str, str]:
        """The engine environment that carries the plan (read by vLLM's worker start)."""
        return {"OMP_NUM_THREADS": str(self.threads), "VLLM_CPU_OMP_THREADS_BIND": self.bind}


def share_threads(*, replica_cpus: float, node_cpu_resource: float, node_cores: int) -> int:
    """Threads for a replica holding `replica_cpus` of a node's `node_cpu_resource` CPUs,
    on a node with `node_cores` usable cores. At least 1; never more than the cores."""
    if node_cores < 1:
        return 1
    if replica_cpus <= 0 or node_cpu_resource <= 0:
        return 1
    share = min(1.0, replica_cpus / node_cpu_resource)
    # A tiny epsilon keeps 4 x 0.25 from flooring to 0.999.
    return max(1, min(node_cores, math.floor(node_cores * share + 1e-9)))


def plan(
    *,
    replica_cpus: float,
    node_cpu_resource: float,
    node_cores: list[int],
    cpu_threads: int | None = None,
    binding: Binding = "nobind",
    take_cores=None,
) -> CpuPlan:
    """The plan of one engine. `node_cores` are the core ids this process may use;
    `take_cores(n, cores)` reserves n of them exclusively (None if too few are free)."""
    threads = cpu_threads or share_threads(
        replica_cpus=replica_cpus, node_cpu_resource=node_cpu_resource, node_cores=len(node_cores)
    )
    if binding == "vllm":
        return CpuPlan(threads, "auto")
    if binding == "exclusive" and take_cores is not None:
        cores = take_cores(threads, node_cores)
        if cores:
            return CpuPlan(len(cores), ",".join(str(c) for c in cores))
    return CpuPlan(threads, "nobind")


def take_exclusive_cores(n: int, node_cores: list[int]) -> list[int] | None:
    """Reserve `n` cores of this node for this process until it exits; None if fewer are
    free. Cores are handed out from the highest id down: Ray's own processes and the
    interpreter's main threads tend to sit on the low ones."""

    def pick(taken: set[int]) -> list[int] | None:
        free = [c for c in sorted(node_cores, reverse=True) if c not in taken]
        return sorted(free[:n]) if len(free) >= n else None

    return _CORE_REGISTRY.reserve(pick)


def plan_for_this_replica(cpu_threads: int | None, binding: Binding) -> CpuPlan:
    """The plan of the engine about to start in this Ray worker process."""
    import ray

    ctx = ray.get_runtime_context()
    replica_cpus = float(ctx.get_assigned_resources().get("CPU", 0.0))
    node_id = ctx.get_node_id()
    node_cpu = next(
        (
            float(n["Resources"].get("CPU", 0.0))
            for n in ray.nodes()
            if n.get("NodeID") == node_id and n.get("Alive")
        ),
        0.0,
    )
    cores = sorted(os.sched_getaffinity(0))
    return plan(
        replica_cpus=replica_cpus,
        node_cpu_resource=node_cpu,
        node_cores=cores,
        cpu_threads=cpu_threads,
        binding=binding,
        take_cores=take_exclusive_cores,
    )
