"""The vLLM adapter: `VLLMEngine` implements `app.engines.wire.Engine` with vLLM's `AsyncLLM` and
the NixlConnector, set up by `app.engines.setup` (side-channel ports, engine arguments, the
plugin's environment); `check_vllm_api` checks the private vLLM API it reads, and
`sampling_params` builds one request's vLLM `SamplingParams`. The only module that runs a
vLLM engine; `app.api` imports vLLM for its request models, output parsers and tokenizer.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from app.config import AppConfig, EngineRoleConfig
from app.engines.setup import (
    apply_env,
    engine_args,
    plugin_env,
    reserve_port_block,
)
from app.engines.sizing import CpuPlan
from app.engines.wire import (
    EngineChunk,
    EngineRequest,
    KVBlocks,
    PromptTokenCounts,
    Sampling,
    TokenLogprob,
)
from connector import release, vllm_plugin
from connector.patching import Unsupported, require, require_set_in_init

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


class VLLMEngine:
    """A vLLM `AsyncLLM` in this process (its engine core runs in a child process)."""

    def __init__(self, cfg: AppConfig, role: EngineRoleConfig, *, name: str, transfer: bool, node_ip: str):
        self._cfg = cfg
        self._role = role
        self.engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self._transfer = transfer
        self._node_ip = node_ip
        self._counts = PromptTokenCounts()
        self._llm: AsyncLLM | None = None
        self.side_channel: tuple[str, int] | None = None
        self.cpu_plan: CpuPlan | None = None
        self.kv_blocks_total: int | None = None
        """Usable KV blocks of the started engine (vLLM's `num_gpu_blocks` less its null block)."""

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        check_vllm_api()

        self.cpu_plan = self._size_cpu()
        apply_env(
            plugin_env(self._cfg.transfer, self._role, transfer=self._transfer, cpu=self.cpu_plan is not None)
        )
        for key, value in self._cfg.env.items():  # the app's `env` has the last word
            os.environ[key] = value
        if self._transfer:
            # Read by the engine-core process vLLM spawns next: its NIXL side channel.
            port = reserve_port_block(
                self._cfg.transfer.side_channel_base_port, self._role.tensor_parallel_size
            )
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self._node_ip
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
            self.side_channel = (self._node_ip, port)
        args = engine_args(self._cfg, self._role, engine_id=self.engine_id, transfer=self._transfer)
        self._llm = AsyncLLM.from_engine_args(
            args, stat_loggers=[self._stat_logger_factory(), *self._metrics_loggers()]
        )
        # One ordinary request before any transfer: a CPU worker was seen to crash on its
        # first request after a NIXL read otherwise.
        warm = EngineRequest("warmup-" + uuid.uuid4().hex, tuple(range(1, 9)), Sampling(max_tokens=2))
        async for _ in self.generate(warm):
            pass
        self._counts = PromptTokenCounts()
        blocks = self._llm.vllm_config.cache_config.num_gpu_blocks
        self.kv_blocks_total = blocks - 1 if blocks else None

    def _size_cpu(self) -> CpuPlan | None:
        """On CPU, give the engine its own thread count and binding (`app.engines.sizing`), unless
        the app's `env` sets them explicitly. Returns the plan applied, if any."""
        from vllm.platforms import current_platform

        from app.engines.sizing import plan_for_this_replica

        if not current_platform.is_cpu():
            return None
        cpu = plan_for_this_replica(self._role.cpu_threads, self._role.cpu_binding)
        env = {**cpu.env(), **self._cfg.env}
        os.environ.update({key: env[key] for key in cpu.env()})
        return CpuPlan(int(env["OMP_NUM_THREADS"]), env["VLLM_CPU_OMP_THREADS_BIND"])

    async def cpu_in_use(self) -> dict | None:
        """The engine's worker process, read back from it: its OpenMP threads (`threads`)
        and the cores the thread that runs the model may use (`cores`)."""
        if self._llm is None:
            return None
        result = await self._llm.collective_rpc(vllm_plugin.WORKER_CPU)
        return dict(result[0]) if result else None

    def _metrics_loggers(self) -> list:
        """Stat loggers that export metrics through Ray (`app.api.metrics`): vLLM's own engine
        metrics (`ray_vllm_*`) and this engine's KV blocks and NIXL reads (`ray_kvturn_engine_*`,
        `ray_kvturn_nixl_*`)."""
        from vllm.v1.metrics.loggers import StatLoggerBase
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        from app.api.metrics import EngineMetrics

        engine_metrics = EngineMetrics(role=self.engine_id.split("-", 1)[0], engine_id=self.engine_id)

        class _RayMetrics(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                self._blocks = vllm_config.cache_config.num_gpu_blocks

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is None:
                    return
                engine_metrics.record_step(
                    kv_cache_usage=scheduler_stats.kv_cache_usage,
                    num_blocks=self._blocks,
                    running=scheduler_stats.num_running_reqs,
                    transfer_stats=getattr(scheduler_stats, "kv_connector_stats", None),
                )

            def log_engine_initialized(self):
                pass

        return [RayPrometheusStatLogger, _RayMetrics]

    def _stat_logger_factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        counts_of = lambda: self._counts  # noqa: E731  (counts are reset after warm-up)

        class _Counter(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                counts = counts_of()
                if scheduler_stats is not None:
                    computed = iteration_stats.prompt_token_stats.computed if iteration_stats else 0
                    counts.busy_step(time.monotonic(), scheduler_stats.num_running_reqs, computed)
                    counts.kv_cache_usage = scheduler_stats.kv_cache_usage
                    transfers = getattr(scheduler_stats, "kv_connector_stats", None)
                    if isinstance(transfers, dict):
                        counts.add_transfers(transfers)
                if iteration_stats is None:
                    return
                p = iteration_stats.prompt_token_stats
                counts.add(p.computed, p.local_cache_hit, p.external_kv_transfer, p.total)
                counts.requests += len(iteration_stats.finished_requests)

            def log_engine_initialized(self):
                pass

        return _Counter

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        from vllm.inputs import TokensPrompt

        params = sampling_params(request)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        timed = False
        assert self._llm is not None  # started
        called = time.monotonic()
        async for out in self._llm.generate(prompt, params, request_id=request.request_id):
            completion = out.outputs[0]
            timings = None
            if not timed and completion.token_ids:
                timings, timed = _engine_timings(out.metrics, called, time.monotonic()), True
            yield EngineChunk(
                token_ids=tuple(completion.token_ids),
                text=completion.text,
                finished=out.finished,
                finish_reason=completion.finish_reason if out.finished else None,
                stop_reason=completion.stop_reason if out.finished else None,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=out.num_cached_tokens or 0,
                kv_params=out.kv_transfer_params if out.finished else None,
                logprobs=_logprobs(completion.token_ids, completion.logprobs, params.logprobs)
                if params.logprobs is not None
                else None,
                engine_timings=timings,
            )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def kv_blocks(self) -> KVBlocks | None:
        """Block counts from the scheduler's block pool: a utility call to the engine
        core (`connector.release`), answered between two steps."""
        if self._llm is None or not self._transfer:
            return None
        counts = await self._llm.engine_core.call_utility_async(release.CORE_BLOCKS)
        return KVBlocks(**counts)

    async def release(self, request_ids: Sequence[str]) -> list[str]:
        """Expire the send pins of `request_ids` in every worker (`connector.release`):
        the engine's next step (within `transfer.idle_poll_ms` when idle) reports them
        finished sending and the scheduler frees their blocks. Only for requests no
        reader will pull any more: a pull already under way may read reused blocks."""
        if self._llm is None or not request_ids:
            return []
        results = await self._llm.collective_rpc(release.WORKER_EXPIRE, args=(list(request_ids),))
        return sorted({request_id for ids in results or () for request_id in ids})

    def counts(self) -> PromptTokenCounts:
        return self._counts

    async def check_health(self) -> None:
        """Raise vLLM's `EngineDeadError` once the engine core died or its output loop stopped."""
        if self._llm is None:
            raise RuntimeError("the engine is shut down")
        await self._llm.check_health()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


def check_vllm_api() -> None:
    """Raise `connector.patching.Unsupported` naming what the installed vLLM lacks of the
    private API this adapter reads: the engine core's utility call (block counts), the
    scheduler's and iteration stats behind the reuse counts, and the request stats behind
    the engine timings. Called by `VLLMEngine.start`: a vLLM that changed them stops the
    replica with a clear message instead of counting nothing."""
    import dataclasses

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.metrics import stats

    require_set_in_init(AsyncLLM, "engine_core")
    require(AsyncMPClient, "call_utility_async")
    require_set_in_init(stats.IterationStats, "prompt_token_stats", "finished_requests")
    for cls, names in (
        (stats.SchedulerStats, ("kv_cache_usage", "num_running_reqs")),
        (stats.PromptTokenStats, ("computed", "local_cache_hit", "external_kv_transfer", "total")),
        (stats.RequestStateStats, ("first_token_ts", "scheduled_ts", "queued_ts", "first_token_latency")),
    ):
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        fields |= set(getattr(cls, "__annotations__", {})) | set(dir(cls))
        missing = [n for n in names if n not in fields]
        if missing:
            raise Unsupported(f"{cls.__name__} has no {', '.join(map(repr, missing))}")


def _engine_timings(stats, called: float | None = None, now: float | None = None) -> dict[str, float] | None:
    """`EngineChunk.engine_timings` from vLLM's `RequestStateStats` (None without stats):
    `queue_s` in the engine core's scheduler (a read of remote KV included) and
    `first_token_s` from the request's arrival to its first output. With `called` and
    `now` (this process's monotonic clock when the request was made and its first output
    came; the engine core stamps the same clock), also the split of that time:
    `input_s` to the engine core, `compute_s` from scheduled to the first token's step,
    `output_s` back to this process."""
    if stats is None or not getattr(stats, "first_token_ts", 0.0):
        return None
    queue = max(0.0, stats.scheduled_ts - stats.queued_ts) if stats.scheduled_ts else 0.0
    out = {"queue_s": round(queue, 5), "first_token_s": round(stats.first_token_latency, 5)}
    if called is not None and now is not None and stats.queued_ts and stats.scheduled_ts:
        out["input_s"] = round(max(0.0, stats.queued_ts - called), 5)
        out["compute_s"] = round(max(0.0, stats.first_token_ts - stats.scheduled_ts), 5)
        out["output_s"] = round(max(0.0, now - stats.first_token_ts), 5)
    return out


def sampling_params(request: EngineRequest):
    """vLLM SamplingParams for one engine request: the client's full params when given
    (a copy: `max_tokens` may have been fitted to the context), else the plain options.
    Output comes as deltas; transfer params ride in `extra_args`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = request.sampling
    extra = {"kv_transfer_params": request.kv_params} if request.kv_params else None
    if s.params is not None:
        params = s.params.clone()
        params.max_tokens = s.max_tokens
        params.output_kind = RequestOutputKind.DELTA
        params.extra_args = {**(params.extra_args or {}), **(extra or {})} or None
        return params
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )


def _logprobs(token_ids, positions, k: int) -> tuple[TokenLogprob, ...]:
    """vLLM's per-position logprob dicts as plain values: the chosen token (always in its
    position's dict) and the `k` top alternatives by rank (-1: all vLLM returned)."""
    out = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        chosen = position.get(token_id)
        ranked = sorted(
            ((tid, lp) for tid, lp in position.items() if lp.rank is not None and (k < 0 or lp.rank <= k)),
            key=lambda x: x[1].rank,
        )
        out.append(
            TokenLogprob(
                token_id=int(token_id),
                logprob=float(chosen.logprob) if chosen is not None else float("nan"),
                token=(chosen.decoded_token or "") if chosen is not None else "",
                top=tuple((int(tid), float(lp.logprob), lp.decoded_token or "") for tid, lp in ranked),
            )
        )
    return tuple(out)
