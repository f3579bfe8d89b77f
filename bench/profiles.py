"""Benchmark profiles: the model, engine settings and workload of a run.

* `cpu` (default): `models/bench-qwen3` (12 layers, hidden 768, random weights) on CPU
  engines, each on half the cores (the app's own sizing); 2 sessions x 6 turns whose history grows to about 8k
  tokens, so prefill dominates. About 12 minutes on 2 cores for the three modes.
* `agentic`: the embedded model with the app's defaults; 2 sessions x 24 short turns (tool
  results of 100-300 tokens) up to ~7k tokens of history, as coding agents run.
* `gpu`: Qwen3-8B's architecture (36 layers, hidden 4096, GQA 32/8, random weights, bf16)
  on one accelerator shared by prefill and decode; 8 sessions x 6 turns, histories to
  about 24k tokens.
* `chat`: the embedded model with the app's defaults, 1 session x 6 turns of ~300 new
  tokens, 16-token answers: the fixed cost of P/D per turn, as `make run` users see it.
* `smoke`: the tiny embedded model, 2 sessions x 2 turns of short texts (tests).
* `elastic`: the agentic workload (6 sessions x 8 turns, ~2.5k-token histories) on 1 prefill
  + 2 decode replicas; one decode replica is removed after turn 4, with the drain's moves
  on and then off (`bench.elastic`).
* `autoscale`: the elastic workload on a decode pool that autoscales 1-2 on KV in use: it
  scales up under load, two more turns run, all but one session end, it scales down
  (the removed replica's conversations move), the kept session goes on.
* `fleet`: agent-trace-shaped sessions (`bench.traces`): Poisson arrivals, log-normal
  turns and heavy-tailed tool results, pauses, subagents sharing their parent's system
  prompt; `--trace FILE` replays a JSONL trace instead.
* `pressure`: the embedded model, 12 agents of up to 6 turns that pause 0-4 s before each
  turn and vanish at random (15% after each turn), on a decode engine of 384 blocks that
  holds about a third of what they would pin: reuse under memory pressure, evictions and
  early releases (the ingress's `released_*` counters).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from app.config import OPEN_MODEL, AppConfig, Mode
from bench.traces import TraceShape
from bench.workload import WorkloadSpec

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    """A path, or the name of a model in `bench.models.SHAPES` (built under models/)."""
    workload: WorkloadSpec
    load_format: str = "dummy"
    dtype: str = "float32"
    enforce_eager: bool = True
    max_model_len: int = 12288
    block_size: int = 32
    prefill_prefix_caching: bool = False
    """Off by default: with one prefill engine serving every session, its own cache would
    keep each session's previous prompt, and `oneway` would stop recomputing the history
    (and `bidir` would find nothing to pull). In a fleet of prefill replicas under
    least-loaded routing a turn rarely lands where the session's last one did."""
    kv_cache_bytes: int | None = 1 * GiB
    """Per engine; None: vLLM's own sizing."""
    decode_kv_cache_bytes: int | None = None
    """The decode engine's (and the single engine's) KV, when it differs from `kv_cache_bytes`."""
    num_cpus: float | None = None
    """Ray CPUs per engine replica; the app sizes each engine's threads from it
    (`app.engines.sizing`). None: half the benchmark cluster's CPUs, so that prefill and decode
    each have their own cores and the single engine gets as many as each of them."""
    cpu_threads: int | None = None
    """Explicit OpenMP threads per engine (`--threads`); None: the app's own sizing."""
    cpu_binding: str | None = None
    """The app's `cpu_binding` per engine (`--cpu-binding`); None: the app's default."""
    num_gpus: float = 0.0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    recompute_threshold_tokens: int = 64
    pull_timeout_s: float | None = None
    """The app's `transfer.pull_timeout_s` (None: the app's default). The app adds the
    compute it expects for the leg's new tokens, so the default suits CPU runs too."""
    decode_local_tokens: int | None = None
    """The app's `transfer.decode_local_tokens` (None: the app's default): bidir turns that
    compute at most this many tokens skip the prefill leg."""
    decode_local_busy_tokens: int | None = None
    """The app's `transfer.decode_local_busy_tokens` (None: the app's default): while
    prefill is busy, bidir turns computing at most this many tokens go to their decode
    replica when that answers sooner."""
    kv_buffer_device: str | None = "cpu"
    host_offload_bytes: int | None = None
    """The app's `transfer.host_offload_bytes` (accelerator engines: a host-memory KV tier)."""
    env: dict[str, str] = field(default_factory=dict)
    sessions: dict[str, Any] = field(default_factory=dict)
    """The app's `sessions.*` settings (e.g. `pinned_fraction`); empty: the app's defaults."""
    transfer: dict[str, Any] = field(default_factory=dict)
    """More of the app's `transfer.*` settings (e.g. `decode_chunk_tokens`), over the rest."""
    trace: TraceShape | None = None
    """A trace-shaped workload (`bench.traces`) in place of `workload`'s uniform sessions
    (`workload` then only names the answer length of the warm-up)."""

    def with_overrides(self, **changes) -> Profile:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def as_dict(self) -> dict:
        d = asdict(self)
        d["workload"] = self.workload.as_dict()
        return d

    def app_config(self, mode: str, model_path: str, app_name: str) -> AppConfig:
        """The app's config for one mode: one prefill and one decode engine (P/D modes),
        one engine (single), or two engines with session affinity and prefix caching
        (dp: `single` with two replicas, the same engine count as P/D)."""
        if mode in (DP, DP_AGAIN):
            cfg = self.app_config(Mode.SINGLE.value, model_path, app_name)
            return cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"num_replicas": 2})})
        if mode == BIDIR_PD:
            every_turn_via_prefill = replace(self, decode_local_tokens=0, decode_local_busy_tokens=0)
            return every_turn_via_prefill.app_config(Mode.BIDIR.value, model_path, app_name)
        if mode == BIDIR_HOST:
            hosts = replace(
                self, prefill_prefix_caching=True, transfer={**self.transfer, "prefill_hosts": True}
            )
            return hosts.app_config(Mode.BIDIR.value, model_path, app_name)
        role = {
            "num_replicas": 1,
            "num_cpus": self.num_cpus if self.num_cpus is not None else engine_cpus(),
            "cpu_threads": self.cpu_threads,
            **({"cpu_binding": self.cpu_binding} if self.cpu_binding else {}),
            "num_gpus": self.num_gpus,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "engine_kwargs": dict(self.engine_kwargs),
        }
        tree = {
            "mode": mode,
            "model": model_path,
            "dtype": self.dtype,
            "load_format": self.load_format,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "enforce_eager": self.enforce_eager,
            "default_max_tokens": self.workload.answer_tokens,
            "prefill": {**role, "enable_prefix_caching": self.prefill_prefix_caching},
            "decode": {
                **role,
                "enable_prefix_caching": True,
                **(
                    {"kv_cache_memory_bytes": self.decode_kv_cache_bytes}
                    if self.decode_kv_cache_bytes
                    else {}
                ),
            },
            "transfer": {
                "recompute_threshold_tokens": self.recompute_threshold_tokens,
                "kv_buffer_device": self.kv_buffer_device,
                **({"pull_timeout_s": self.pull_timeout_s} if self.pull_timeout_s else {}),
                **{
                    key: value
                    for key in ("decode_local_tokens", "decode_local_busy_tokens")
                    if (value := getattr(self, key)) is not None
                },
                **({"host_offload_bytes": self.host_offload_bytes} if self.host_offload_bytes else {}),
                **self.transfer,
            },
            "app_name": app_name,
            "env": dict(self.env),
        }
        if self.sessions:
            tree["sessions"] = dict(self.sessions)
        return AppConfig.model_validate(tree)


def cluster_cpus() -> int:
    """CPUs the benchmark's own Ray cluster advertises: the machine's cores."""
    return max(2, os.cpu_count() or 2)


def engine_cpus() -> float:
    return float(max(1, cluster_cpus() // 2))


def cpu_env() -> dict[str, str]:
    """Engine environment on CPU: NIXL over loopback. Threads and binding come from the
    app's own sizing (`app.engines.sizing`), as in any deployment."""
    return {"UCX_NET_DEVICES": "lo"}


def profile(name: str) -> Profile:
    if name == "cpu":
        return Profile(
            name="cpu",
            model="bench-qwen3",
            # Seed 4: every later turn of both sessions is a tool result, so both
            # histories reach ~8k tokens; the run takes about 12 minutes on 2 cores.
            workload=WorkloadSpec(
                sessions=2,
                turns=6,
                concurrency=2,
                system_tokens=600,
                user_tokens=200,
                tool_tokens=1400,
                answer_tokens=32,
                tool_prob=0.8,
                seed=4,
            ),
            dtype="float32",
            enforce_eager=True,
            max_model_len=12288,
            kv_cache_bytes=1 * GiB,
            env=cpu_env(),
        )
    if name == "agentic":
        return Profile(
            name="agentic",
            model=str(OPEN_MODEL),
            # A coding agent on the embedded model with the app's defaults: 2 sessions of 24
            # short turns, mostly tool results of 100-300 tokens, histories growing to ~7k
            # tokens; each turn adds little, so recomputing the history (oneway) is nearly
            # all of the work and reuse matters most.
            workload=WorkloadSpec(
                sessions=2,
                turns=24,
                concurrency=2,
                system_tokens=400,
                user_tokens=80,
                tool_tokens=300,
                tool_tokens_min=100,
                answer_tokens=24,
                tool_prob=0.85,
                seed=1,
            ),
            load_format="auto",
            dtype="float32",
            enforce_eager=False,
            max_model_len=8192,
            kv_cache_bytes=None,
            recompute_threshold_tokens=32,
            env=cpu_env(),
        )
    if name == "gpu":
        return Profile(
            name="gpu",
            model="bench-qwen3-8b",
            workload=WorkloadSpec(
                sessions=8,
                turns=6,
                concurrency=8,
                system_tokens=2000,
                user_tokens=300,
                tool_tokens=4400,
                answer_tokens=128,
                tool_prob=0.8,
            ),
            dtype="bfloat16",
            enforce_eager=False,
            max_model_len=32768,
            # Prefill and decode share the accelerator: half of it each (the single
            # engine gets the same half).
            kv_cache_bytes=32 * GiB,
            num_cpus=1.0,
            num_gpus=0.5,
            engine_kwargs={"gpu_memory_utilization": 0.45},
            kv_buffer_device=None,
            env={},
        )
    if name == "chat":
        return Profile(
            name="chat",
            model=str(OPEN_MODEL),
            # What a user of `make run` sees: the embedded model with the app's defaults
            # (compiled, 1 GiB KV), one session of 6 turns adding ~300 tokens each,
            # 16-token answers. Measures the fixed cost of P/D per turn.
            workload=WorkloadSpec(
                sessions=1,
                turns=6,
                concurrency=1,
                system_tokens=100,
                user_tokens=300,
                tool_tokens=300,
                answer_tokens=16,
                tool_prob=0.5,
                seed=2,
            ),
            load_format="auto",
            dtype="float32",
            enforce_eager=False,
            max_model_len=4096,
            kv_cache_bytes=None,
            recompute_threshold_tokens=32,
            env=cpu_env(),
        )
    if name == "smoke":
        return Profile(
            name="smoke",
            model=str(OPEN_MODEL),
            workload=WorkloadSpec(
                sessions=2,
                turns=2,
                concurrency=2,
                system_tokens=80,
                user_tokens=30,
                tool_tokens=120,
                answer_tokens=8,
                tool_prob=0.5,
            ),
            load_format="auto",
            dtype="float32",
            enforce_eager=True,
            max_model_len=2048,
            kv_cache_bytes=128 * MiB,
            recompute_threshold_tokens=32,
            # Short turns would stay on decode (decode_local_tokens), and a burst would be
            # spread over decode (decode_local_busy_tokens): prove the pulls instead.
            decode_local_tokens=0,
            decode_local_busy_tokens=0,
            env=cpu_env(),
        )
    if name == "pressure":
        return Profile(
            name="pressure",
            model=str(OPEN_MODEL),
            # A fleet that pauses and vanishes on a small decode engine: 12 agents of up to
            # 6 turns (~3k tokens each by the end), a pause of 0-4 s before each later turn,
            # and a 15% chance after each turn from the second that the agent is gone for
            # good. The embedded model's float32 KV is 128 KiB a block: decode gets 48 MiB
            # (384 blocks, half of them for pins) where the conversations would pin ~1,100.
            workload=WorkloadSpec(
                sessions=12,
                turns=6,
                concurrency=12,
                system_tokens=300,
                user_tokens=150,
                tool_tokens=500,
                answer_tokens=24,
                tool_prob=0.7,
                pause_s=2.0,
                abandon_prob=0.15,
                seed=3,
            ),
            load_format="auto",
            dtype="float32",
            enforce_eager=False,
            max_model_len=8192,
            kv_cache_bytes=256 * MiB,
            decode_kv_cache_bytes=48 * MiB,
            recompute_threshold_tokens=32,
            sessions={"pinned_fraction": 0.5, "release_interval_s": 0.5},
            # Every turn pins and pulls through prefill: the path under pressure here.
            decode_local_tokens=0,
            decode_local_busy_tokens=0,
            env=cpu_env(),
        )
    if name == "elastic":
        agentic = profile("agentic")
        # The agentic workload with longer histories (~2.5k tokens by the downscale), every
        # session in flight (the run holds them all at one turn); 1 prefill + 2 decode
        # replicas, half a CPU each (`bench.elastic`).
        return replace(
            agentic,
            name="elastic",
            workload=replace(
                agentic.workload,
                sessions=6,
                turns=8,
                concurrency=6,
                system_tokens=1000,
                tool_tokens=600,
                tool_tokens_min=200,
                seed=5,
            ),
            num_cpus=0.5,
        )
    if name == "autoscale":
        # The elastic workload on a decode pool that autoscales 1-2 on KV in use; decode
        # engines of 128 MiB (1,023 blocks of the embedded model): the six conversations
        # pin about a quarter of them after four turns, past the target of 0.15, and one
        # left alone about a twelfth (`bench.elastic.autoscale_main`).
        return replace(profile("elastic"), name="autoscale", decode_kv_cache_bytes=128 * MiB)
    if name == "fleet":
        # Agent traces (`bench.traces.TraceShape`) scaled to 2 cores: agents arriving at
        # 0.8/s (one in six a subagent sharing its parent's system prompt), 10 turns at the
        # median, tool results of ~200 tokens at the median with a heavy tail to 3k, 1 s
        # pauses, histories up to 8k tokens. `bench.fleet` ramps the agents (4-32). The
        # model is the embedded one's dimensions at 32k positions, random weights.
        return replace(
            profile("agentic"),
            name="fleet",
            model="fleet-qwen3",
            load_format="dummy",
            max_model_len=32768,
            trace=TraceShape(
                sessions=8,
                arrival_rate_per_s=0.8,
                turns_median=10,
                turns_max=16,
                system_tokens=1000,
                tool_median_tokens=200,
                tool_max_tokens=3000,
                answer_median_tokens=24,
                pause_median_s=1.0,
                subagent_prob=0.15,
                max_history_tokens=8000,
                seed=1,
            ),
        )
    if name == "fleet-32k":
        # The fleet workload with histories to 32k tokens (the model's positions): 16 turns at
        # the median (up to 32), tool results of ~600 tokens (tail to 6k); 2 GiB of KV an engine.
        fleet = profile("fleet")
        longer = dict(turns_median=16, turns_max=32, tool_median_tokens=600, tool_max_tokens=6000)
        trace = replace(fleet.trace, max_history_tokens=32000, **longer)  # type: ignore[type-var,arg-type]
        return replace(fleet, name="fleet-32k", kv_cache_bytes=2 * GiB, trace=trace)
    if name == "fleet-gpu":
        # The fleet workload at agent sizes for one accelerator (the gpu profile's engines):
        # Codex-like traces, 20 turns at the median, tool results of ~1k tokens with a tail
        # to 12k, histories up to 30k tokens. Levels 4-64 agents.
        return replace(
            profile("gpu"),
            name="fleet-gpu",
            trace=TraceShape(
                sessions=8,
                arrival_rate_per_s=1.0,
                turns_median=20,
                turns_max=40,
                system_tokens=4000,
                tool_median_tokens=1000,
                tool_max_tokens=12000,
                answer_median_tokens=100,
                pause_median_s=2.0,
                subagent_prob=0.15,
                max_history_tokens=30000,
                seed=1,
            ),
        )
    raise ValueError(f"unknown profile {name!r} ({', '.join(PROFILES)})")


PROFILES: tuple[str, ...] = ("cpu", "agentic", "chat", "gpu", "smoke", "pressure", "elastic", "autoscale")
PROFILES += ("fleet", "fleet-32k", "fleet-gpu")
DP = "dp"
"""Data-parallel engines with session affinity: what agent operators run without P/D."""
BIDIR_PD = "bidir-pd"
"""bidir with every turn through prefill (no turn computed on decode): decode engines
only decode, whatever arrives."""
BIDIR_HOST = "bidir-host"
"""bidir whose prefill replica hosts sessions while load is low (`transfer.prefill_hosts`,
with prefix caching on prefill)."""
DP_AGAIN = "dp-again"
"""dp deployed again in the same run: each ratio against dp beside the same setup's own."""
MODES = tuple(m.value for m in (Mode.ONEWAY, Mode.BIDIR, Mode.SINGLE)) + (DP, BIDIR_PD, BIDIR_HOST, DP_AGAIN)
"""Every mode a run can deploy."""
DEFAULT_MODES = MODES[:3]
"""What a run deploys without `--modes`."""
