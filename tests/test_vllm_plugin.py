"""`connector.vllm_plugin`: the engine core waits for requests instead of spinning when
only delayed block frees are left. Checked on a stand-in with vLLM's step hook."""

from __future__ import annotations

import queue
import threading
import time
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from connector import patching, vllm_plugin


class FakeScheduler:
    def __init__(self, running=0, waiting=0):
        self.running, self.waiting = running, waiting

    def get_request_counts(self):
        return self.running, self.waiting


class FakeCore:
    """Has what the patch touches: the step hook, the scheduler, the input queue."""

    def __init__(self, scheduler, executed=False):
        self.scheduler = scheduler
        self.executed = executed
        self.input_queue: queue.Queue = queue.Queue()
        self.handled: list[tuple] = []
        self.steps = 0

    def _process_engine_step(self) -> bool:
        self.steps += 1
        return self.executed

    def _handle_client_request(self, *request):
        self.handled.append(request)


@pytest.fixture
def core_class():
    class Core(FakeCore):
        pass

    return Core


def test_entry_point_is_registered():
    """pyproject.toml declares the plugin, and the installed metadata (what vLLM loads)
    agrees with it: a stale install would list an older name."""
    target = "connector.vllm_plugin:register"
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {"kvturn": target}
    installed = [e.name for e in entry_points(group="vllm.general_plugins") if e.value == target]
    assert installed == ["kvturn"], f"installed as {installed}: reinstall the project (pip install -e .)"


def test_patch_modules_do_not_import_each_other():
    """`connector.patching` imports nothing of the project, and `connector.release` does
    not import the plugin: the plugin imports both."""
    import subprocess
    import sys

    code = (
        "import sys; import connector.patching; "
        "assert [m for m in sys.modules if m.startswith('connector.')] == ['connector.patching']; "
        "import connector.release; "
        "assert 'connector.vllm_plugin' not in sys.modules; "
        "import connector.vllm_plugin"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_is_inert_without_the_variable(monkeypatch):
    from vllm.v1.engine.core import EngineCoreProc as EngineCore

    monkeypatch.delenv(vllm_plugin.ENV_IDLE_POLL_MS, raising=False)
    before = EngineCore._process_engine_step
    vllm_plugin.register()
    assert EngineCore._process_engine_step is before


def test_idle_engine_waits_the_interval(core_class):
    vllm_plugin.patch_engine_core(0.2, core_class)
    core = core_class(FakeScheduler())
    started = time.monotonic()
    assert core._process_engine_step() is False
    assert time.monotonic() - started >= 0.19
    assert core.steps == 1 and core.handled == []


def test_new_request_wakes_the_idle_engine(core_class):
    vllm_plugin.patch_engine_core(5.0, core_class)
    core = core_class(FakeScheduler())
    threading.Timer(0.05, core.input_queue.put, args=(("ADD", "req-1"),)).start()
    started = time.monotonic()
    core._process_engine_step()
    assert time.monotonic() - started < 2.0
    assert core.handled == [("ADD", "req-1")]


@pytest.mark.parametrize("running, waiting, executed", [(1, 0, False), (0, 1, False), (0, 0, True)])
def test_engine_with_work_does_not_wait(core_class, running, waiting, executed):
    # waiting includes requests whose KV is still being pulled: they keep the fast loop.
    vllm_plugin.patch_engine_core(5.0, core_class)
    core = core_class(FakeScheduler(running, waiting), executed=executed)
    started = time.monotonic()
    assert core._process_engine_step() is executed
    assert time.monotonic() - started < 1.0


def test_patching_twice_updates_the_interval(core_class):
    vllm_plugin.patch_engine_core(5.0, core_class)
    patched = core_class._process_engine_step
    vllm_plugin.patch_engine_core(0.01, core_class)
    assert core_class._process_engine_step is patched
    core = core_class(FakeScheduler())
    started = time.monotonic()
    core._process_engine_step()
    assert core.steps == 1 and time.monotonic() - started < 1.0


def test_register_patches_the_engine_core_when_enabled():
    # In a fresh interpreter, as vLLM's engine-core process loads it.
    import subprocess
    import sys

    code = (
        "from connector import vllm_plugin; vllm_plugin.register(); "
        "from vllm.v1.engine.core import EngineCoreProc as C; "
        "print(C._process_engine_step._kvturn_idle_poll)"
    )
    env = {**__import__("os").environ, vllm_plugin.ENV_IDLE_POLL_MS: "25"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "0.025"


# -- patches check what they replace ----------------------------------------------------------


def test_the_installed_vllm_has_what_every_patch_replaces():
    from vllm import __version__

    assert __version__.startswith(patching.SUPPORTED_VLLM)
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.v1.engine.core import EngineCoreProc

    patching.require(EngineCoreProc, "_process_engine_step", "_handle_client_request")
    patching.require(SpinCondition, "wait")
    patching.require_set_in_init(SpinCondition, "busy_loop_s", "last_read")
    patching.require(base_worker, "os")
    # The NIXL worker still pins the thread that creates it: the affinity patch is needed.
    assert "sched_setaffinity" in __import__("inspect").getsource(
        base_worker.NixlBaseConnectorWorker.__init__
    )


def test_a_patch_whose_target_changed_is_skipped_with_a_warning(caplog):
    class OlderCore:  # a vLLM whose engine core has no such step hook
        def _handle_client_request(self, *request):
            pass

    class OlderCondition:
        def __init__(self):
            self.spin_s = 1.0  # renamed: the patch would read a missing attribute

        def wait(self, timeout_ms=None):
            pass

    with pytest.raises(patching.Unsupported, match="_process_engine_step"):
        vllm_plugin.patch_engine_core(0.02, OlderCore)
    with pytest.raises(patching.Unsupported, match="busy_loop_s"):
        vllm_plugin.patch_message_queue_spin(0.0, OlderCondition)
    assert OlderCondition.wait.__name__ == "wait"  # left as it was
    with caplog.at_level("WARNING", logger=patching.__name__):
        assert not patching.apply_patch(
            "the idle engine's wait", vllm_plugin.patch_engine_core, 0.02, OlderCore
        )
    assert (
        "the idle engine's wait is off in this engine" in caplog.text
        and "_process_engine_step" in caplog.text
    )
    assert not hasattr(OlderCore, "_process_engine_step")


# -- NIXL's progress thread ------------------------------------------------------------------


class FakeConfig:
    def __init__(self):
        self.pthrDelay = 0
        self.useProgThread = True


class FakeBindings:
    nixlAgentConfig = FakeConfig
    other = "passed through"


class FakeApi:
    nixlBind = FakeBindings


def test_agent_config_delay_has_a_floor():
    api = FakeApi()
    vllm_plugin.patch_nixl_progress_delay(5000, api)
    config = api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0  # what NIXL's Python agent sets
    assert config.pthrDelay == 5000
    config.pthrDelay = 20000
    assert config.pthrDelay == 20000
    config.useProgThread = False
    assert config.useProgThread is False
    assert api.nixlBind.other == "passed through"
    vllm_plugin.patch_nixl_progress_delay(1000, api)  # again: updates, never wraps twice
    assert isinstance(api.nixlBind._inner, type) and api.nixlBind._inner is FakeBindings
    config = api.nixlBind.nixlAgentConfig()
    config.pthrDelay = 0
    assert config.pthrDelay == 1000


IDLE_AGENTS = """
import resource, sys, time, torch
from connector import vllm_plugin
vllm_plugin.register()
from nixl._api import nixl_agent, nixl_agent_config
a, b = nixl_agent("A", nixl_agent_config(num_threads=4)), nixl_agent("B", nixl_agent_config(num_threads=4))
src, dst = torch.arange(4096, dtype=torch.int32), torch.zeros(4096, dtype=torch.int32)
a.register_memory(src); b.register_memory(dst)
b.add_remote_agent(a.get_agent_metadata()); a.add_remote_agent(b.get_agent_metadata())
h = b.initialize_xfer("READ", b.get_xfer_descs(dst), a.get_xfer_descs(src), "A", b"done")
b.transfer(h)
deadline = time.monotonic() + 30
while b.check_xfer_state(h) not in ("DONE", "ERR") and time.monotonic() < deadline:
    pass
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0 = cpu(); time.sleep(2.0)
print(b.check_xfer_state(h), bool(torch.equal(src, dst)), round(cpu() - c0, 3))
"""


def test_idle_nixl_agents_do_not_spin():
    # Real NIXL agents over UCX on loopback, in a fresh interpreter as in an engine's
    # worker: the transfer completes, and two idle agents use a small fraction of a core
    # (unpatched, each progress thread takes a full core).
    import os
    import subprocess
    import sys

    env = {**os.environ, vllm_plugin.ENV_NIXL_PROGRESS_DELAY_US: "5000", "UCX_NET_DEVICES": "lo"}
    out = subprocess.run(
        [sys.executable, "-c", IDLE_AGENTS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    state, copied, cpu_seconds = out.stdout.split()[-3:]
    assert state == "DONE" and copied == "True"
    assert float(cpu_seconds) < 0.5  # over 2 s of idling


# -- the engine core and its worker waiting for each other -------------------------------

QUEUE_READER = """
import threading, time
from connector import vllm_plugin
vllm_plugin.register()  # reads KVTURN_WORKER_SPIN_MS, as in an engine core or worker
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
writer = MessageQueue(1, 1)  # vLLM's step queue: one writer, one local reader
handle = writer.export_handle()
got, cpu, latency = [], [], []
def read():
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready()
    got.append(reader.dequeue())
    t0 = time.thread_time()
    got.append(reader.dequeue())  # written a second later, as a long step's output would be
    latency.append(time.monotonic() - sent[0])
    cpu.append(time.thread_time() - t0)
sent = []
thread = threading.Thread(target=read)
thread.start()
writer.wait_until_ready()
writer.enqueue("step-1")
time.sleep(1.0)
sent.append(time.monotonic())
writer.enqueue("step-2")
thread.join()
print(",".join(got), round(cpu[0], 3), round(latency[0], 4))
"""


@pytest.mark.parametrize("spin_ms", [None, "0"])
def test_queue_reader_sleeps_until_notified(spin_ms):
    # vLLM's own shared-memory queue in a fresh interpreter: unpatched, a reader that just
    # got a message spins for the next one (most of a core for the second it waits);
    # patched, it sleeps and still gets the next message as soon as it is written.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != vllm_plugin.ENV_WORKER_SPIN_MS}
    if spin_ms is not None:
        env[vllm_plugin.ENV_WORKER_SPIN_MS] = spin_ms
    out = subprocess.run(
        [sys.executable, "-c", QUEUE_READER], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    messages, cpu_seconds, latency = out.stdout.split()[-3:]
    assert messages == "step-1,step-2"
    if spin_ms is None:
        assert float(cpu_seconds) > 0.2
    else:
        assert float(cpu_seconds) < 0.05
        assert float(latency) < 0.05


STEP_ROUND_TRIPS = """
import random, threading, time
from connector import vllm_plugin
vllm_plugin.register()
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
steps = MessageQueue(1, 1)  # engine core -> worker
steps_handle, outputs_handle, latency = steps.export_handle(), [], []
def worker():
    reader = MessageQueue.create_from_handle(steps_handle, 0)
    reader.wait_until_ready()
    outputs = MessageQueue(1, 1)
    outputs_handle.append(outputs.export_handle())
    outputs.wait_until_ready()
    for _ in range(300):
        latency.append(time.monotonic() - reader.dequeue())
        time.sleep(random.random() * 0.01)  # the step's compute
        outputs.enqueue(time.monotonic())
thread = threading.Thread(target=worker)
thread.start()
steps.wait_until_ready()
while not outputs_handle:
    time.sleep(0.01)
outputs = MessageQueue.create_from_handle(outputs_handle[0], 0)
outputs.wait_until_ready()
for _ in range(300):
    steps.enqueue(time.monotonic())
    latency.append(time.monotonic() - outputs.dequeue())
thread.join()
print(len(latency), round(max(latency), 4))
"""


def test_sleeping_queue_readers_never_stall_a_step():
    # 300 steps through vLLM's two queues, as between an engine core and its worker: a
    # reader that sleeps on the notification alone misses some (vLLM finds the message at
    # its 5 s recheck); with the plugin's rechecks every message is read within milliseconds.
    import os
    import subprocess
    import sys

    env = {**os.environ, vllm_plugin.ENV_WORKER_SPIN_MS: "0"}
    out = subprocess.run(
        [sys.executable, "-c", STEP_ROUND_TRIPS], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    messages, slowest = out.stdout.split()[-2:]
    assert messages == "600"
    assert float(slowest) < 0.1


def test_queue_spin_patch_bounds_the_sleep_and_never_wraps_twice():
    class Condition:
        def __init__(self):
            self.busy_loop_s, self.last_read, self.timeouts = 1.0, time.monotonic(), []

        def wait(self, timeout_ms=None):
            self.timeouts.append(timeout_ms)

    vllm_plugin.patch_message_queue_spin(0.002, Condition)
    first = Condition.wait
    condition = Condition()
    condition.wait()  # just read: recheck after 1 ms
    assert condition.busy_loop_s == 0.002 and condition.timeouts == [1]
    condition.last_read -= 0.4  # waited 400 ms: recheck after 50 ms
    condition.wait(timeout_ms=5000)
    condition.last_read -= 100.0  # idle: never longer than QUEUE_RECHECK_MAX_MS
    condition.wait()
    condition.wait(timeout_ms=3)  # a shorter timeout of the caller's own is kept
    assert condition.timeouts[1:] == [50, vllm_plugin.QUEUE_RECHECK_MAX_MS, 3]
    vllm_plugin.patch_message_queue_spin(0.0, Condition)
    assert Condition.wait is first
    condition.wait()
    assert condition.busy_loop_s == 0.0


# -- lifetime guard ------------------------------------------------------------------------

_ENGINE = """
import os, subprocess, sys, time
from connector import vllm_plugin
vllm_plugin.GUARD_POLL_S = 0.1
vllm_plugin.register()  # reads KVTURN_OWNER_PID, as vLLM's plugin loader would
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(os.getpid(), worker.pid, flush=True)
time.sleep(600)
"""

# A vLLM worker below the engine core loads the plugin too; a plain child does not.
_GUARDED_WORKER = "from connector import vllm_plugin; vllm_plugin.register(); import time; time.sleep(600)"
_PLAIN_CHILD = "import time; time.sleep(600)"

_OWNER = """
import os, subprocess, sys
os.environ["KVTURN_OWNER_PID"] = str(os.getpid())
engine = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
print(engine.stdout.readline().strip(), flush=True)
import time; time.sleep(600)
"""


def _gone(pid: int, within_s: float) -> bool:
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _env(**extra):
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    return repo, {**os.environ, "PYTHONPATH": repo, **extra}


def test_engine_tree_dies_with_its_owner():
    """The replica (owner) is SIGKILLed: the engine core and its worker die (kernel
    parent-death signal, and the guard thread)."""
    import signal
    import subprocess
    import sys

    repo, env = _env()
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, _ENGINE, _GUARDED_WORKER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env=env,
    )
    engine, worker = map(int, owner.stdout.readline().split())
    time.sleep(1.0)
    assert not _gone(engine, 0.3) and not _gone(worker, 0.1), "the guard must not fire while the owner lives"
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _gone(engine, 5) and _gone(worker, 5)


def test_guard_kills_the_tree_when_the_owner_is_gone():
    """The owner is not the parent (a worker below the engine core, or an owner that died
    without the parent noticing): the guard thread kills this process and its children."""
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    repo, env = _env(KVTURN_OWNER_PID=str(owner.pid))
    engine_proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, _PLAIN_CHILD], stdout=subprocess.PIPE, text=True, cwd=repo, env=env
    )
    engine, child = map(int, engine_proc.stdout.readline().split())
    time.sleep(0.5)
    assert not _gone(engine, 0.3)
    owner.kill()
    owner.wait()
    assert _gone(engine, 5) and _gone(child, 5)
    engine_proc.wait(5)


def test_guard_is_inert_in_the_owner(monkeypatch):
    import os

    assert vllm_plugin.guard_lifetime(os.getpid()) is None


def test_owner_gone_sees_a_dead_owner_or_a_new_parent():
    import os

    assert not vllm_plugin.owner_gone(os.getppid(), os.getppid())
    assert vllm_plugin.owner_gone(os.getppid(), os.getppid() + 1)  # re-parented
    assert vllm_plugin.owner_gone(2**22 + 12345, os.getppid())  # no such process


def test_plugin_env_per_engine_kind():
    """What an engine's processes are started with (`app.engines.setup.plugin_env`): the step-queue
    spin only on CPU engines, the transfer settings only on engines with the connector."""
    import os

    from app.config import EngineRoleConfig, TransferConfig
    from app.engines.setup import apply_env, plugin_env
    from connector import release

    role = EngineRoleConfig()
    cpu_pd = plugin_env(
        TransferConfig(idle_poll_ms=20, nixl_progress_poll_ms=5), role, transfer=True, cpu=True
    )
    assert cpu_pd == {
        vllm_plugin.ENV_IDLE_POLL_MS: "20.0",
        vllm_plugin.ENV_NIXL_PROGRESS_DELAY_US: "5000",
        release.ENV_RELEASE: "1",
        vllm_plugin.ENV_WORKER_INFO: "1",
        vllm_plugin.ENV_WORKER_SPIN_MS: str(role.cpu_spin_ms),
        vllm_plugin.ENV_KEEP_CPU_AFFINITY: "1",
    }
    assert role.cpu_spin_ms == 0.0  # CPU engines sleep on their step queues by default
    gpu_single = plugin_env(TransferConfig(), role, transfer=False, cpu=False)
    assert gpu_single == {}
    vllm_spin = plugin_env(TransferConfig(), EngineRoleConfig(cpu_spin_ms=None), transfer=False, cpu=True)
    assert vllm_spin[vllm_plugin.ENV_WORKER_SPIN_MS] is None  # vLLM's own second: unset
    assert vllm_spin[vllm_plugin.ENV_KEEP_CPU_AFFINITY] is None  # no connector: nothing pins
    os.environ[vllm_plugin.ENV_WORKER_SPIN_MS] = "3"
    try:
        apply_env(vllm_spin)
        assert vllm_plugin.ENV_WORKER_SPIN_MS not in os.environ
        assert os.environ[vllm_plugin.ENV_WORKER_INFO] == "1"
    finally:
        os.environ.pop(vllm_plugin.ENV_WORKER_SPIN_MS, None)
        os.environ.pop(vllm_plugin.ENV_WORKER_INFO, None)


def test_the_installed_vllm_has_the_private_api_the_engine_adapter_reads(monkeypatch):
    from vllm.v1.metrics import stats

    from app.engines.engine import check_vllm_api
    from connector.patching import Unsupported

    check_vllm_api()  # raises Unsupported naming what is missing

    class OlderStats:  # a vLLM whose request stats lost a field the timings read
        first_token_ts = 0.0
        queued_ts = 0.0

    monkeypatch.setattr(stats, "RequestStateStats", OlderStats)
    with pytest.raises(Unsupported, match="scheduled_ts"):
        check_vllm_api()
