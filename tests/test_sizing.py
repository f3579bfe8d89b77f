"""Engine sizing: threads and binding per engine from the cores Ray gives each replica."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.config import AppConfig
from app.engines.registry import NodeRegistry
from app.engines.sizing import CpuPlan, plan, share_threads


@pytest.mark.parametrize(
    "replica_cpus, node_cpus, cores, expected",
    [
        (1, 2, 2, 1),  # `make run` defaults on a 2-core laptop: one core each for P and D
        (1, 16, 16, 1),
        (8, 16, 16, 8),  # half a 16-core node
        (4, 16, 8, 2),  # the node advertises more CPUs than it has cores
        (0.5, 8, 2, 1),  # test clusters over-advertise: never below one thread
        (0.25, 1, 4, 1),
        (32, 16, 16, 16),  # never more threads than cores
        (0, 16, 16, 1),  # no CPU reserved (num_cpus=0)
        (2, 0, 16, 1),  # unknown node resource
    ],
)
def test_share_threads(replica_cpus, node_cpus, cores, expected):
    assert share_threads(replica_cpus=replica_cpus, node_cpu_resource=node_cpus, node_cores=cores) == expected


def test_engines_placed_by_ray_never_oversubscribe_the_node():
    """Whatever mix of whole-CPU replicas Ray fits on a node (sum of num_cpus <= node
    CPUs), the engines' threads add up to at most the node's cores. (A replica with a
    fraction of a CPU still runs one thread.)"""
    for cores in (2, 8, 16, 64):
        for shares in (
            [1, 1],
            [cores // 2, cores // 2],
            [max(1, cores // 4)] * 4,
            [1] * cores,
            [1, cores - 1],
        ):
            if sum(shares) > cores:
                continue
            threads = [
                share_threads(replica_cpus=s, node_cpu_resource=cores, node_cores=cores) for s in shares
            ]
            assert sum(threads) <= cores, (cores, shares, threads)


def test_default_app_config_sizes_one_thread_per_engine_on_two_cores():
    cfg = AppConfig.from_args({})
    plans = [
        plan(
            replica_cpus=role.num_cpus,
            node_cpu_resource=2,
            node_cores=[0, 1],
            cpu_threads=role.cpu_threads,
            binding=role.cpu_binding,
        )
        for role in (cfg.prefill, cfg.decode)
    ]
    assert plans == [CpuPlan(1, "nobind"), CpuPlan(1, "nobind")]
    assert plans[0].env() == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_explicit_threads_and_vllm_binding():
    assert plan(replica_cpus=1, node_cpu_resource=2, node_cores=[0, 1], cpu_threads=3) == CpuPlan(3, "nobind")
    assert plan(replica_cpus=1, node_cpu_resource=2, node_cores=[0, 1], binding="vllm") == CpuPlan(1, "auto")


def test_exclusive_binding_takes_disjoint_cores_then_falls_back_to_nobind(tmp_path):
    registry = NodeRegistry(str(tmp_path / "cores"))
    cores = list(range(8))

    def take(n, node_cores, pid):
        def pick(taken):
            free = [c for c in sorted(node_cores, reverse=True) if c not in taken]
            return sorted(free[:n]) if len(free) >= n else None

        return registry.reserve(pick, pid=pid)

    me = os.getpid()
    parent = os.getppid()
    first = plan(
        replica_cpus=4,
        node_cpu_resource=8,
        node_cores=cores,
        binding="exclusive",
        take_cores=lambda n, c: take(n, c, me),
    )
    second = plan(
        replica_cpus=3,
        node_cpu_resource=8,
        node_cores=cores,
        binding="exclusive",
        take_cores=lambda n, c: take(n, c, parent),
    )
    assert first == CpuPlan(4, "4,5,6,7")
    assert second == CpuPlan(3, "1,2,3")
    # Two cores left: a third 2-thread engine fits, a 4-thread one runs unbound.
    third = plan(
        replica_cpus=4,
        node_cpu_resource=8,
        node_cores=cores,
        binding="exclusive",
        take_cores=lambda n, c: take(n, c, parent),
    )
    assert third == CpuPlan(4, "nobind")


def test_registry_drops_entries_of_dead_processes(tmp_path):
    registry = NodeRegistry(str(tmp_path / "ports"))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    assert registry.reserve(lambda taken: [5600], pid=dead_pid) == [5600]
    # The holder is gone: its value is free again, and a live holder's is not.
    assert registry.reserve(lambda taken: [v for v in (5600, 5601) if v not in taken][:1]) == [5600]
    assert registry.reserve(lambda taken: [v for v in (5600, 5601) if v not in taken][:1]) == [5601]
    assert registry.reserve(lambda taken: None) is None


def test_plugin_gives_workers_a_method_that_reports_threads_and_cores():
    import torch

    from connector import vllm_plugin

    class Worker:
        pass

    vllm_plugin.install_worker_info(Worker)
    assert getattr(Worker(), vllm_plugin.WORKER_CPU)() == {
        "threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)),
    }


def test_the_nixl_worker_keeps_the_cores_of_the_thread_that_creates_it():
    import types

    from connector import vllm_plugin

    cores = os.sched_getaffinity(0)
    # What vLLM's NIXL worker does on CPU: pin the creating thread to the last core.
    module = types.SimpleNamespace(os=os)

    def nixl_worker_init():
        module.os.sched_setaffinity(0, {max(module.os.sched_getaffinity(0))})
        return module.os.getpid()

    vllm_plugin.keep_cpu_affinity(module)
    vllm_plugin.keep_cpu_affinity(module)  # idempotent: one wrapper
    assert isinstance(module.os, vllm_plugin._OsKeepingAffinity) and module.os._inner is os
    try:
        assert nixl_worker_init() == os.getpid()
        assert os.sched_getaffinity(0) == cores
    finally:
        os.sched_setaffinity(0, cores)


def test_cpu_engines_resolve_auto_dtype_to_float32_and_keep_explicit_ones():
    from app.engines.setup import engine_dtype

    # vLLM's `auto` would run the embedded float32 model in bfloat16 on CPU.
    assert engine_dtype("auto", on_cpu=True) == "float32"
    assert engine_dtype("bfloat16", on_cpu=True) == "bfloat16"
    assert engine_dtype("auto", on_cpu=False) == "auto"


def test_benchmark_sizes_engines_through_the_app_config():
    """`python -m bench --threads/--cpu-binding` set the app's own role fields (no separate recipe)."""
    from bench.__main__ import _profile_from, parse_args

    prof = _profile_from(parse_args(["--profile", "chat", "--threads", "3", "--cpu-binding", "exclusive"]))
    cfg = prof.app_config("bidir", "m", "a")
    for role in (cfg.prefill, cfg.decode):
        assert (role.cpu_threads, role.cpu_binding) == (3, "exclusive")
    default = _profile_from(parse_args(["--profile", "chat"])).app_config("single", "m", "a")
    assert (default.decode.cpu_threads, default.decode.cpu_binding) == (None, "nobind")
