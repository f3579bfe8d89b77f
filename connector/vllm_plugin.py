"""A vLLM general plugin, loaded in every vLLM process of this environment (entry point
`vllm.general_plugins` in pyproject.toml). It does nothing unless the engine was started
by our servers, which set the variables below in the engine's environment. Three fixes for
CPU burnt by busy loops (on a 2-core host the first two halved P/D TTFT), one for cores the
NixlConnector takes from the model, and a guard that ends the engine's processes with their
replica. The fixes replace private vLLM and NIXL code: each checks what it replaces before
patching, and on a vLLM where that changed it is skipped with a warning
(`connector.patching`). `register` also installs early release (`connector.release`).

1. NIXL's progress thread (`KVTURN_NIXL_PROGRESS_DELAY_US`). NIXL's Python agent
creates its UCX backend with a progress-thread poll timeout of 0: the thread that
serves transfers busy-polls a full core in every engine process, idle or not (measured:
one core per agent, before and after any transfer). The thread wakes on UCX's event fd
whenever there is work, and also after this timeout (a guard against missed wake-ups),
so a timeout of a few milliseconds costs no latency and frees the core.

2. The engine core's step loop (`KVTURN_IDLE_POLL_MS`). A decode engine keeps each
finished turn's blocks pinned for the next turn's pull (`decoder_kv_blocks_ttl`), and
vLLM keeps stepping its engine while any finished request awaits such a delayed free:
an empty schedule and a worker round trip every millisecond, for as long as any
conversation is open. When a step ran no model and nothing is running or waiting (only
delayed frees and connector bookkeeping are left), the engine core now waits up to this
interval for a new request instead of 1 ms. A request that arrives wakes it at once, so
latency is unchanged; transfer completions are polled at that interval, which only
delays the release of blocks whose reader is already done. Requests waiting for remote
KV count as waiting: the engine keeps its fast loop while a pull is in flight. Each poll
is itself an empty step (a worker round trip, an output to the replica), so the app polls
twice a second (`transfer.idle_poll_ms`): at 20 ms the two engines of a P/D pair burnt
about a fifth of a core between turns (docs/benchmarks.md).

3. The engine core and its worker waiting for each other (`KVTURN_WORKER_SPIN_MS`). vLLM
runs the model in a worker process beside the engine core and passes every step's input
and output through shared-memory queues; a reader that got a message in the last second
spins (`sched_yield`) for the next one instead of sleeping on the queue's notification.
So the engine core keeps a core busy while its worker computes a step, and the worker
while the engine core schedules the next: on a CPU node those are the cores the models
compute on (measured on 2 cores, prefill beside decode: the decode engine core took
35-70% of a core, and prefill's worker fell to 50-75% of one). Readers now spin at most
this long, then sleep until the writer's notification. Notifications can be lost (~1% of
steps; vLLM's reader would find the message only at its 5 s recheck), so a sleeping
reader also rechecks the queue after an eighth of the time it has waited (1-50 ms).

4. The NixlConnector's core pinning (`KVTURN_KEEP_CPU_AFFINITY`). On a CPU engine, vLLM's
NIXL worker pins the thread that creates it to the last core of each NUMA node, meaning to
keep transfers off the model's cores. That thread is the worker's main thread, the one that
runs the model (the OpenMP team's first thread, the only one at one thread per engine), and
every engine of the node picks the same core: prefill and decode computed on one core of two
while the other served Ray and the ingress (measured on 2 cores: each worker at 50% of a core
whenever both computed; bidir's TTFT 1.31x single's at turn 6 of the cpu profile). The
connector now leaves the thread's cores as the app's sizing set them (`app.engines.sizing`): all of
the node's with `nobind`, the engine's own with `exclusive`.

5. The engine's lifetime (`KVTURN_OWNER_PID`). vLLM runs the engine core in a child
process of the replica (and, with several workers, workers below it). Signals that reach
those processes first (SIGINT to the process group, then SIGTERM and `ray stop --force`)
were seen to leave them running, re-parented to init and ignoring SIGTERM. In every vLLM
process other than the owner (the replica process named by the variable) a daemon thread
watches the owner: once it is gone, or this process was re-parented (its parent died),
it SIGKILLs this process's children and then itself. The kernel backs it up: the process
also asks for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), which works even when the
interpreter is stuck (a thread can starve on the GIL or freeze in finalization). That
signal fires when the parent *thread* that spawned the process exits: the replica starts
its engine from Serve's user-code event loop thread, which lives as long as the replica,
and vLLM's engine core starts its workers from its main thread.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from connector import release
from connector.patching import Unsupported, apply_patch, require, require_set_in_init

ENV_IDLE_POLL_MS = "KVTURN_IDLE_POLL_MS"
ENV_KEEP_CPU_AFFINITY = "KVTURN_KEEP_CPU_AFFINITY"
ENV_NIXL_PROGRESS_DELAY_US = "KVTURN_NIXL_PROGRESS_DELAY_US"
ENV_OWNER_PID = "KVTURN_OWNER_PID"
ENV_WORKER_SPIN_MS = "KVTURN_WORKER_SPIN_MS"
ENV_WORKER_INFO = "KVTURN_WORKER_INFO"
WORKER_CPU = "kvturn_cpu_in_use"
GUARD_POLL_S = 0.5
QUEUE_RECHECK_MAX_MS = 50
"""The longest a step-queue reader that sleeps instead of spinning goes without rechecking."""

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point. Safe to call many times and in any vLLM process."""
    interval_ms = _number(ENV_IDLE_POLL_MS)
    if interval_ms:
        apply_patch("the idle engine's wait", patch_engine_core, interval_ms / 1000.0)
    delay_us = _number(ENV_NIXL_PROGRESS_DELAY_US)
    if delay_us:
        apply_patch("NIXL's progress-thread delay", patch_nixl_progress_delay, int(delay_us))
    spin_ms = os.environ.get(ENV_WORKER_SPIN_MS)
    if spin_ms:
        try:
            spin_s = max(0.0, float(spin_ms)) / 1000.0
        except ValueError:
            logger.warning("ignoring %s=%r (not a number)", ENV_WORKER_SPIN_MS, spin_ms)
        else:
            apply_patch("the step queues' bounded spin", patch_message_queue_spin, spin_s)
    if os.environ.get(ENV_KEEP_CPU_AFFINITY) == "1":
        apply_patch("the model thread's cores", keep_cpu_affinity)
    owner = _number(ENV_OWNER_PID)
    if owner:
        guard_lifetime(int(owner))
    if os.environ.get(ENV_WORKER_INFO) == "1":
        apply_patch("the workers' CPU report", install_worker_info)
    # Early release of decode-pinned blocks and block counts (connector.release).
    release.register()


def _number(name: str) -> float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        logger.warning("ignoring %s=%r (not a number)", name, value)
        return None
    return number if number > 0 else None


def patch_nixl_progress_delay(delay_us: int, api=None) -> None:
    """Make NIXL agents created from now on in this process use a progress-thread poll
    timeout of at least `delay_us`. `api` is NIXL's Python API module (default: the one
    `nixl._api` resolves to)."""
    if api is None:
        try:
            from nixl import _api
        except ImportError:  # no NIXL here: nothing to patch
            return
        api = _api
    require(api, "nixlBind")
    bind = api.nixlBind
    if isinstance(bind, _Bindings):
        bind.delay_us = delay_us
        return
    require(bind, "nixlAgentConfig")
    api.nixlBind = _Bindings(bind, delay_us)


class _Bindings:
    """NIXL's bindings module as the Python API sees it, with an agent config whose
    progress-thread delay cannot be set below `delay_us`."""

    def __init__(self, inner, delay_us: int):
        self._inner = inner
        self.delay_us = delay_us
        bindings = self

        class nixlAgentConfig(inner.nixlAgentConfig):
            def __setattr__(self, name, value):
                if name == "pthrDelay":
                    value = max(int(value), bindings.delay_us)
                super().__setattr__(name, value)

        self.nixlAgentConfig = nixlAgentConfig

    def __getattr__(self, name):
        return getattr(self._inner, name)


def patch_engine_core(interval_s: float, engine_core_class: type[Any] | None = None) -> None:
    """Patch `EngineCoreProc` (or the given class with the same step hook) in this process."""
    if engine_core_class is None:
        from vllm.v1.engine.core import EngineCoreProc

        engine_core_class = EngineCoreProc

    require(engine_core_class, "_process_engine_step", "_handle_client_request")
    step = engine_core_class._process_engine_step
    if getattr(step, "_kvturn_idle_poll", None) is not None:
        step._kvturn_idle_poll = interval_s
        return

    def _process_engine_step(self) -> bool:
        model_executed = step(self)
        if not model_executed and only_delayed_work(self.scheduler):
            wait_for_request(self, _process_engine_step._kvturn_idle_poll)  # type: ignore[attr-defined]
        return model_executed

    _process_engine_step._kvturn_idle_poll = interval_s  # type: ignore[attr-defined]
    engine_core_class._process_engine_step = _process_engine_step


def patch_message_queue_spin(spin_s: float, spin_condition_class: type[Any] | None = None) -> None:
    """Make the readers of vLLM's shared-memory message queues in this process (the engine
    core reading its workers' outputs, a worker reading the next step) spin at most `spin_s`
    after a message before they sleep until the writer's notification. Takes effect at a
    reader's next wait, for queues created before the call too."""
    if spin_condition_class is None:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        spin_condition_class = SpinCondition

    require(spin_condition_class, "wait")
    require_set_in_init(spin_condition_class, "busy_loop_s", "last_read")
    wait = spin_condition_class.wait
    if getattr(wait, "_kvturn_spin_s", None) is not None:
        wait._kvturn_spin_s = spin_s
        return

    def bounded_wait(self, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > bounded_wait._kvturn_spin_s:  # type: ignore[attr-defined]
            self.busy_loop_s = bounded_wait._kvturn_spin_s  # type: ignore[attr-defined]
        # A notification can be lost (measured: ~1% of steps; vLLM's reader then finds the
        # message at its next recheck, 5 s later). A sleeping reader rechecks the queue
        # after an eighth of the time it has waited so far (1 ms to QUEUE_RECHECK_MAX_MS):
        # a lost notification costs at most ~12% of a step, an idle engine wakes rarely.
        waited_ms = (time.monotonic() - self.last_read) * 1000.0
        recheck_ms = int(min(QUEUE_RECHECK_MAX_MS, max(1.0, waited_ms / 8)))
        if timeout_ms is None or timeout_ms > recheck_ms:
            timeout_ms = recheck_ms
        return wait(self, timeout_ms)

    bounded_wait._kvturn_spin_s = spin_s  # type: ignore[attr-defined]
    spin_condition_class.wait = bounded_wait


def keep_cpu_affinity(module=None) -> None:
    """Make vLLM's NIXL worker (`module`: the module that defines it; default vLLM's) leave
    the CPU affinity of the thread that creates it as it was: its calls to
    `os.sched_setaffinity` are logged and skipped. Threads it starts inherit the same cores."""
    if module is None:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        except ImportError as e:
            raise Unsupported(f"no NIXL worker module ({e})") from e
        module = base_worker
    require(module, "os")
    if not isinstance(module.os, _OsKeepingAffinity):
        module.os = _OsKeepingAffinity(module.os)


class _OsKeepingAffinity:
    """The `os` module as the NIXL worker sees it, without `sched_setaffinity`'s effect."""

    def __init__(self, inner):
        self._inner = inner

    def sched_setaffinity(self, pid: int, cores) -> None:
        logger.info(
            "keeping CPU affinity %s of pid %d (the NIXL worker asked for cores %s)",
            sorted(self._inner.sched_getaffinity(pid)),
            pid,
            sorted(cores),
        )

    def __getattr__(self, name):
        return getattr(self._inner, name)


def only_delayed_work(scheduler) -> bool:
    """Nothing to compute now: no request running or waiting (including requests that
    wait for remote KV), only finished ones whose blocks a connector still holds."""
    running, waiting = scheduler.get_request_counts()
    return running == 0 and waiting == 0


def wait_for_request(core, timeout_s: float) -> None:
    """Block on the engine core's input queue for at most `timeout_s`; handle what comes."""
    try:
        request = core.input_queue.get(timeout=timeout_s)
    except queue.Empty:
        return
    core._handle_client_request(*request)


_guard: tuple[int, threading.Thread] | None = None
"""(pid of the process that started it, the thread): a forked child starts its own."""


def guard_lifetime(owner_pid: int, poll_s: float = GUARD_POLL_S) -> threading.Thread | None:
    """In a process below `owner_pid` (not the owner itself), start once a daemon thread
    that kills this process tree when the owner dies or this process is re-parented.
    Returns the thread (None in the owner). Checks every `poll_s`: a process tree
    outlives its owner by at most that, plus the time to kill it."""
    global _guard
    me = os.getpid()
    if owner_pid == me:
        return None
    if _guard is not None and _guard[0] == me and _guard[1].is_alive():
        return _guard[1]
    parent = os.getppid()
    set_parent_death_signal()
    thread = threading.Thread(
        target=_watch, args=(owner_pid, parent, poll_s), name="kvturn-lifetime-guard", daemon=True
    )
    thread.start()
    _guard = (me, thread)
    return thread


def set_parent_death_signal() -> bool:
    """Ask the kernel (Linux) to SIGKILL this process when the thread that spawned it exits.
    Returns whether it was set. A parent that died before this call is caught by the
    guard's first check (the parent changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except Exception:
        return False


def owner_gone(owner_pid: int, parent_pid: int) -> bool:
    """The owner process no longer exists, or this process's parent changed (it died and
    this process was re-parented to init or a subreaper)."""
    if os.getppid() != parent_pid:
        return True
    try:
        os.kill(owner_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _watch(owner_pid: int, parent_pid: int, poll_s: float) -> None:
    while not owner_gone(owner_pid, parent_pid):
        time.sleep(poll_s)
    logger.warning(
        "owner process %d is gone: killing vLLM process %d and its children", owner_pid, os.getpid()
    )
    kill_tree()


def kill_tree() -> None:
    """SIGKILL every descendant of this process, then this process."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # psutil missing or the tree changed under us: kill ourselves anyway
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def install_worker_info(worker_class: type[Any] | None = None) -> None:
    """Give vLLM's workers a method that reports their intra-op (OpenMP) thread count and
    the cores the thread that runs the model may use, for
    `AsyncLLM.collective_rpc(WORKER_CPU)`: how the servers read back the engine's sizing
    (a function sent to the worker would need vLLM's insecure pickle fallback)."""
    if worker_class is None:
        from vllm.v1.worker.worker_base import WorkerBase

        worker_class = WorkerBase

    setattr(worker_class, WORKER_CPU, _cpu_in_use)


def _cpu_in_use(self) -> dict:
    import torch

    # RPCs run on the worker's main thread: the one that runs the model.
    return {"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}
