"""A vLLM general plugin, loaded in every vLLM process of this environment (entry point
`vllm.general_plugins` in pyproject.toml). It does nothing unless the engine was started
by our servers, which set `KVTURN_IDLE_POLL_MS` in the engine's environment.

Why: a decode engine keeps each finished turn's blocks pinned for the next turn's pull
(`decoder_kv_blocks_ttl`), and vLLM keeps stepping its engine while any finished request
awaits such a delayed free: an empty schedule and a worker round trip every millisecond,
which keeps two threads busy for as long as any conversation is open. On a GPU host
that is a core per engine; on a CPU host it is the cores the model runs on.

What: when a step ran no model and nothing is running or waiting (only delayed frees
and connector bookkeeping are left), the engine core waits up to `KVTURN_IDLE_POLL_MS`
for a new request instead of 1 ms. A request that arrives wakes it at once, so latency
is unchanged; transfer completions are polled at that interval, which only delays the
release of blocks whose reader is already done. Requests waiting for remote KV count
as waiting: the engine keeps its fast loop while a pull is in flight.
"""

from __future__ import annotations

import logging
import os
import queue

ENV_IDLE_POLL_MS = "KVTURN_IDLE_POLL_MS"

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point. Safe to call many times and in any vLLM process."""
    value = os.environ.get(ENV_IDLE_POLL_MS)
    if not value:
        return
    try:
        interval_s = float(value) / 1000.0
    except ValueError:
        logger.warning("ignoring %s=%r (not a number)", ENV_IDLE_POLL_MS, value)
        return
    if interval_s > 0:
        patch_engine_core(interval_s)


def patch_engine_core(interval_s: float, engine_core_class: type | None = None) -> None:
    """Patch `EngineCoreProc` (or the given class with the same step hook) in this process."""
    if engine_core_class is None:
        from vllm.v1.engine.core import EngineCoreProc as engine_core_class
    EngineCore = engine_core_class

    if getattr(EngineCore._process_engine_step, "_kvturn_idle_poll", None) is not None:
        EngineCore._process_engine_step._kvturn_idle_poll = interval_s
        return
    step = EngineCore._process_engine_step

    def _process_engine_step(self) -> bool:
        model_executed = step(self)
        if not model_executed and only_delayed_work(self.scheduler):
            wait_for_request(self, _process_engine_step._kvturn_idle_poll)
        return model_executed

    _process_engine_step._kvturn_idle_poll = interval_s
    EngineCore._process_engine_step = _process_engine_step


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
