"""How a vLLM engine of the app is set up before it starts: its NIXL side-channel ports
(reserved per node), its engine arguments for a role, and the environment the project's
vLLM plugin reads in the engine's processes. Called by `app.engines.engine.VLLMEngine.start`
(`plugin_env` also by `bench.prefill_cost`). Imports vLLM only inside the functions that
build vLLM config objects.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from app.config import AppConfig, EngineRoleConfig, Mode, TransferConfig
from app.engines.registry import NodeRegistry
from connector import release, vllm_plugin

_PORT_REGISTRY = "/tmp/kvturn-side-channel-ports"


def _bindable(port: int, width: int) -> bool:
    socks = []
    try:
        for offset in range(width):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("", port + offset))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def reserve_port_block(start: int, width: int, registry: str = _PORT_REGISTRY) -> int:
    """Reserve [port, port + width) for this process's NIXL side channel on this node.

    Replicas on one node start at the same time, so a plain "is it free?" check races:
    reservations go through a node-local registry (`app.engines.registry`). vLLM adds the TP rank
    to the base port.
    """

    def pick(taken: set[int]) -> list[int] | None:
        port = start
        while port + width < 65535:
            block = list(range(port, port + width))
            if not taken.intersection(block) and _bindable(port, width):
                return block
            port += width
        return None

    block = NodeRegistry(registry).reserve(pick)
    if not block:
        raise RuntimeError(f"no free port block of width {width} from {start}")
    return block[0]


CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


def engine_dtype(dtype: str, *, on_cpu: bool) -> str:
    """The dtype an engine runs. vLLM's `auto` turns a float32 checkpoint into bfloat16; on
    CPU this app resolves `auto` to float32 instead: CPUs without AVX512-BF16 run bfloat16
    far slower, and with 16-bit KV a turn computed over a pulled prefix can break a near-tie
    differently from a fresh prefill. Any explicit dtype is kept."""
    return "float32" if dtype == "auto" and on_cpu else dtype


def engine_args(cfg: AppConfig, role: EngineRoleConfig, *, engine_id: str, transfer: bool):
    """vLLM AsyncEngineArgs for one role. `transfer` adds the NixlConnector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    kv_transfer_config = None
    if transfer:
        device = cfg.transfer.kv_buffer_device or ("cpu" if current_platform.is_cpu() else "cuda")
        kv_transfer_config = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device=device,
            engine_id=engine_id,
            # Prefill answers normally when a pull fails; decode never fails a turn either.
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "backends": [cfg.transfer.backend],
                "bidirectional_kv_xfer": cfg.mode is Mode.BIDIR,
                "kv_recompute_threshold": cfg.transfer.recompute_threshold_tokens,
                "decoder_kv_blocks_ttl": cfg.transfer.decoder_kv_blocks_ttl_s,
            },
        )
        if cfg.transfer.host_offload_bytes:
            if current_platform.is_cpu():
                raise ValueError(
                    "transfer.host_offload_bytes needs accelerator engines: "
                    "on CPU the KV cache already is host memory"
                )
            kv_transfer_config = with_host_offload(kv_transfer_config, cfg.transfer.host_offload_bytes)
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        tokenizer=cfg.tokenizer,
        served_model_name=[cfg.model_name],
        dtype=engine_dtype(cfg.dtype, on_cpu=current_platform.is_cpu()),
        load_format=cfg.load_format,
        max_model_len=cfg.max_model_len,
        block_size=cfg.block_size,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=role.enable_prefix_caching,
        tensor_parallel_size=role.tensor_parallel_size,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=False,
    )
    if role.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = role.kv_cache_memory_bytes
    elif current_platform.is_cpu():
        # On CPU vLLM otherwise reserves a fraction of all host RAM per engine, and the
        # second engine on a machine refuses to start.
        kwargs["kv_cache_memory_bytes"] = CPU_DEFAULT_KV_CACHE_BYTES
    if cfg.openai.compact_json:
        from vllm.config import StructuredOutputsConfig

        # Grammars without free whitespace (xgrammar's option; structural tags are made
        # compact per request by `app.api.openai_api.compact_structural_tag`).
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(
            backend="xgrammar", disable_any_whitespace=True
        )
    kwargs.update(decode_chunking(cfg, role))
    kwargs.update(role.engine_kwargs)
    return AsyncEngineArgs(**kwargs)


VLLM_DEFAULT_MAX_NUM_SEQS = 128
"""vLLM's `max_num_seqs` for an engine built from `AsyncEngineArgs` (its engine usage
context) when a role's `engine_kwargs` set none."""


def decode_chunking(cfg: AppConfig, role: EngineRoleConfig) -> dict[str, int]:
    """Chunked-prefill arguments of a decode engine in the P/D modes (`role is cfg.decode`,
    as the builder binds it; a prefill engine too where it hosts sessions,
    `transfer.prefill_hosts`): a prompt computed there (a decode-local turn, a recompute)
    takes at most `transfer.decode_chunk_tokens` tokens a step, and a step has room for one
    token of every running stream besides (`max_num_batched_tokens`), so each step that
    computes a prompt grows by a bounded amount (`app.turn.placement` prices it). Empty for
    other engines, with `decode_chunk_tokens` 0, and where `engine_kwargs` set either."""
    chunk = min(cfg.transfer.decode_chunk_tokens, cfg.max_model_len)
    own = ("long_prefill_token_threshold", "max_num_batched_tokens")
    streams = role is cfg.decode or (role is cfg.prefill and cfg.prefill_hosts)  # it streams answers
    if not streams or not cfg.disaggregated or chunk <= 0:
        return {}
    if any(key in role.engine_kwargs for key in own):
        return {}
    seqs = int(role.engine_kwargs.get("max_num_seqs") or VLLM_DEFAULT_MAX_NUM_SEQS)
    return {"long_prefill_token_threshold": chunk, "max_num_batched_tokens": chunk + seqs}


def decode_prompt_chunk(cfg: AppConfig) -> int:
    """The most tokens of a prompt a decode engine computes in one step, as its engine
    arguments set it (`decode_chunking`, or the decode role's own `engine_kwargs`); 0:
    not bounded by the app (a whole prompt within vLLM's default budget). Read by the
    ingress to price a decode-local turn (`app.turn.placement.Limits.chunk_tokens`)."""
    if not cfg.disaggregated:
        return 0
    args = {**decode_chunking(cfg, cfg.decode), **cfg.decode.engine_kwargs}
    values = [int(args[k]) for k in ("long_prefill_token_threshold", "max_num_batched_tokens") if args.get(k)]
    return min(values) if values else 0


def plugin_env(
    transfer_cfg: TransferConfig, role: EngineRoleConfig, *, transfer: bool, cpu: bool
) -> dict[str, str | None]:
    """What `connector.vllm_plugin` and `connector.release` read in an engine's processes,
    for an engine of `role` (None: unset the variable). Set by `VLLMEngine.start` before
    vLLM spawns the engine core; `bench.prefill_cost` runs its engines with it too.

    * `transfer` (an engine with the NixlConnector): NIXL's UCX progress thread polls with
      a timeout instead of spinning, an idle engine holding blocks for transfer waits
      instead of looping every millisecond, and early release is installed.
    * `cpu` (a CPU engine): the worker reports its OpenMP threads and cores, and the step
      queues' readers spin at most `role.cpu_spin_ms` (None: vLLM's own second).
    * both: the NixlConnector leaves the cores of the thread that runs the model as the
      app's sizing set them (it would pin every engine of a node to one core)."""
    env: dict[str, str | None] = {}
    if transfer:
        env[vllm_plugin.ENV_IDLE_POLL_MS] = str(transfer_cfg.idle_poll_ms)
        env[vllm_plugin.ENV_NIXL_PROGRESS_DELAY_US] = str(int(transfer_cfg.nixl_progress_poll_ms * 1000))
        env[release.ENV_RELEASE] = "1"
    if cpu:
        env[vllm_plugin.ENV_WORKER_INFO] = "1"  # lets `VLLMEngine.cpu_in_use` ask the worker
        env[vllm_plugin.ENV_WORKER_SPIN_MS] = None if role.cpu_spin_ms is None else str(role.cpu_spin_ms)
        env[vllm_plugin.ENV_KEEP_CPU_AFFINITY] = "1" if transfer else None
    return env


def apply_env(env: dict[str, str | None]) -> None:
    """Set (or, for None, unset) these variables in this process's environment."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def with_host_offload(nixl, host_bytes: int):
    """`nixl`'s KVTransferConfig inside a MultiConnector beside vLLM's OffloadingConnector
    (CPU tier of `host_bytes` per engine): blocks the engine frees (turns released early,
    pins that expired) stay in its prefix cache in host DRAM and load back locally at the
    next turn, instead of being recomputed or read over NIXL. NIXL stays first: its
    transfer params are the ones the turn's handles carry."""
    from vllm.config import KVTransferConfig

    child = lambda config: {  # noqa: E731
        "kv_connector": config.kv_connector,
        "kv_role": config.kv_role,
        "kv_buffer_device": config.kv_buffer_device,
        "kv_load_failure_policy": config.kv_load_failure_policy,
        "kv_connector_extra_config": dict(config.kv_connector_extra_config),
    }
    offload = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": int(host_bytes)},
    }
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        engine_id=nixl.engine_id,
        kv_buffer_device=nixl.kv_buffer_device,
        kv_load_failure_policy=nixl.kv_load_failure_policy,
        kv_connector_extra_config={"connectors": [child(nixl), offload]},
    )
