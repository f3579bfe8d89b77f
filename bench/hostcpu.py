"""CPU seconds by the role of the process that spent them, on this machine.

The fleet study reads these around each level: the serving processes' CPU per turn
(everything but the engines' model workers) is what the simulation's `HostCpu` charges a
turn (`bench.sim.params.cpu_fleet`). Process titles name the roles: vLLM's engine
workers and schedulers (`VLLM::Worker`, `VLLM::EngineCore`), Serve's replicas
(`ServeReplica:<app>:<deployment>`, with the method running now), proxy and controller,
and this process (the load generator).
"""

from __future__ import annotations

import os

ROLES = ("engine_worker", "engine_core", "ingress", "engine_front", "store", "proxy", "controller", "client")
HOST_ROLES = ROLES[1:]
"""Work beside the engines' model steps, competing with them for the cores."""


def role_of(title: str, pid: int) -> str | None:
    if pid == os.getpid():
        return "client"
    if "VLLM::Worker" in title:
        return "engine_worker"
    if "EngineCore" in title:
        return "engine_core"
    if "ServeReplica:" in title:
        # ray::ServeReplica:<app>:<deployment>[.<method running now>]
        deployment = title.split("ServeReplica:", 1)[1].split(":")[-1].split(".")[0]
        if deployment == "Ingress":
            return "ingress"
        if deployment.endswith("Server"):
            return "engine_front"
        return "store"
    if "ProxyActor" in title:
        return "proxy"
    if "ServeController" in title:
        return "controller"
    return None


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) each role's live processes have spent so far."""
    import psutil

    out = dict.fromkeys(ROLES, 0.0)
    for p in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        try:
            title = " ".join(p.info["cmdline"] or ()).strip() or (p.info["name"] or "")
            role = role_of(title, p.pid)
            times = p.info["cpu_times"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if role is not None and times is not None:
            out[role] += times.user + times.system
    return out


def spent(before: dict[str, float], after: dict[str, float], turns: int) -> dict[str, float | None]:
    """CPU seconds per role between two readings, and the host's per turn."""
    used = {role: round(max(0.0, after[role] - before[role]), 2) for role in ROLES}
    host = sum(used[r] for r in HOST_ROLES)
    return {**used, "host_per_turn_s": round(host / turns, 3) if turns else None}
