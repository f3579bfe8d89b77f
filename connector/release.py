"""Early release of a decode engine's pinned KV blocks, and the engine's own block counts.

With bi-directional transfer, vLLM's NixlConnector keeps every finished decode request's
blocks pinned until a prefill engine reads them or `decoder_kv_blocks_ttl` passes. vLLM
has no call to give them back sooner. The connector's worker keeps the pins as
`_reqs_to_send: request_id -> expiry` and, on every `get_finished` of a step, reports the
expired ones as finished sending; the scheduler then frees their blocks. So a release is
an expiry moved to now: the next engine step frees the blocks through vLLM's own path
(the engine logs it as "Releasing expired KV blocks for request ...").

The worker only tracks (and so only expires, releases, or frees on a reader's
notification) pins of requests the scheduler put "in batch" when it allocated them, and
vLLM 0.32 does that for requests that read remote KV or keep theirs for a decode engine,
not for a decode request that computes its prompt itself (`local_decode_params`: a
decode-local turn, or a turn whose prefill leg was skipped). Those blocks were pinned for
good: no TTL, no early release, a prefill engine's read notification ignored as
"unrecognized". `track_local_decode_pins` puts them in batch like the others.

Installed by `register()` (called from the project's vLLM plugin, in every vLLM process,
only when the engine was started with `ENV_RELEASE=1` by our servers):

* `WorkerBase.kvturn_expire_sends(request_ids)`: run in each worker by
  `AsyncLLM.collective_rpc(WORKER_EXPIRE, args=(ids,))`; returns the ids it released.
* `EngineCore.kvturn_kv_blocks()`: a utility call of the engine core (the scheduler's
  process); returns `block_counts` of its block pool.
* the NixlConnector scheduler's `update_state_after_alloc`, wrapped by
  `track_local_decode_pins`.

All three depend on private vLLM 0.32 internals: the methods they call and the state they
read and write (the worker's `_reqs_to_send`, the connector's `connector_worker` or a
MultiConnector's `_connectors`, the engine core's scheduler, its `requests` and its KV
cache manager's block pool). `check_support()` checks each of them on vLLM's own classes
with `connector.patching`, and `track_local_decode_pins` checks what it wraps. When
something is missing, `register()` installs nothing of that patch (with the warning of
`connector.patching.apply_patch`), so a caller gets a clear "method not implemented"
instead of a wrong release.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from connector.patching import Unsupported, apply_patch, require, require_set_in_init

ENV_RELEASE = "KVTURN_RELEASE"
WORKER_EXPIRE = "kvturn_expire_sends"
CORE_BLOCKS = "kvturn_kv_blocks"

logger = logging.getLogger(__name__)


def register() -> None:
    """Install the two methods in this process when our servers asked for them."""
    if os.environ.get(ENV_RELEASE) != "1":
        return
    apply_patch("early release", _install_in_vllm)
    apply_patch("the pins of decode-local turns", track_local_decode_pins)


def _install_in_vllm() -> None:
    check_support()
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.worker_base import WorkerBase

    install(WorkerBase, EngineCore)


def install(worker_class: type, engine_core_class: type) -> None:
    setattr(worker_class, WORKER_EXPIRE, _worker_expire_sends)
    setattr(engine_core_class, CORE_BLOCKS, _engine_core_kv_blocks)


def check_support() -> None:
    """Raise `Unsupported` naming what the installed vLLM lacks for early release and
    block counts: what `expire_sends`, `nixl_worker_of` and `block_counts` read, write
    or call, on the classes that vLLM builds those objects from."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.request import Request
    except ImportError as exc:
        raise Unsupported(f"vLLM module missing: {exc}") from exc
    # Worker side: the connector group, the NIXL worker inside it, and its send pins,
    # whose expiry vLLM's own reaping acts on.
    require(kv_transfer_state, "get_kv_transfer_group", "has_kv_transfer_group")
    require_set_in_init(NixlConnector, "connector_worker")
    require_set_in_init(MultiConnector, "_connectors")
    require_set_in_init(NixlBaseConnectorWorker, "_reqs_to_send")
    require(NixlBaseConnectorWorker, "_reap_expired_send_leases")
    # Engine-core side: the scheduler's requests and its block pool.
    require_set_in_init(EngineCore, "scheduler")
    require_set_in_init(Scheduler, "kv_cache_manager", "requests")
    require(Scheduler, "_update_from_kv_xfer_finished")
    require(Request, "is_finished")
    require_set_in_init(KVCacheManager, "block_pool")
    require(KVCacheManager, "get_block_ids")
    require_set_in_init(BlockPool, "num_gpu_blocks")
    require(BlockPool, "get_num_free_blocks")


# -- scheduler side -------------------------------------------------------------------


def track_local_decode_pins(scheduler_class: type[Any] | None = None) -> None:
    """Make the NixlConnector scheduler (`scheduler_class`, default vLLM's pull scheduler)
    put a bidirectional decode request whose params name no transfer in the batch its
    worker tracks, as vLLM does for requests that read remote KV: once it finishes, its
    pinned blocks get the decoder TTL, can be released early, and are freed when a
    prefill engine's read of them is done."""
    if scheduler_class is None:
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
                NixlPullConnectorScheduler,
            )
        except ImportError as exc:
            raise Unsupported(f"no NIXL pull scheduler ({exc})") from exc
        scheduler_class = NixlPullConnectorScheduler
    require(scheduler_class, "update_state_after_alloc", "request_finished")
    require_set_in_init(scheduler_class, "_reqs_in_batch", "is_bidirectional_kv_xfer_enabled")
    original = scheduler_class.update_state_after_alloc
    if getattr(original, "_kvturn_tracks_local", False):
        return

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        local = bool(params) and not params.get("do_remote_decode") and not params.get("do_remote_prefill")
        original(self, request, blocks, num_external_tokens)
        if local and self.is_bidirectional_kv_xfer_enabled:
            self._reqs_in_batch.add(request.request_id)

    update_state_after_alloc._kvturn_tracks_local = True  # type: ignore[attr-defined]
    scheduler_class.update_state_after_alloc = update_state_after_alloc


# -- worker side ----------------------------------------------------------------------


def expire_sends(nixl_worker: Any, request_ids: Iterable[str]) -> list[str]:
    """Move the send-pin expiry of `request_ids` to now in a NixlConnector worker.

    Returns the ids that were pinned here (others were already read, expired, or are not
    this worker's). Runs on the engine's step thread (a collective RPC is handled between
    steps), so it never races `get_finished`."""
    pins: dict[str, float] = nixl_worker._reqs_to_send
    released = []
    for request_id in request_ids:
        if request_id in pins:
            pins[request_id] = 0.0
            released.append(request_id)
    return released


def nixl_worker_of(connector: Any) -> Any | None:
    """The NixlConnector worker inside `connector` (itself, or one of a MultiConnector's)."""
    worker = getattr(connector, "connector_worker", None)
    if worker is not None and hasattr(worker, "_reqs_to_send"):
        return worker
    for sub in getattr(connector, "_connectors", ()) or ():
        found = nixl_worker_of(sub)
        if found is not None:
            return found
    return None


def _worker_expire_sends(worker, request_ids: list[str]) -> list[str]:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    nixl = nixl_worker_of(get_kv_transfer_group())
    if nixl is None:
        raise RuntimeError("this engine has no NixlConnector worker to release blocks from")
    return expire_sends(nixl, request_ids)


# -- engine-core side -------------------------------------------------------------------


def block_counts(scheduler: Any) -> dict[str, int]:
    """The engine's KV blocks from its scheduler's block pool.

    `total`: usable blocks (the pool's null block excluded); `free`: blocks a new request
    can get (free or evictable prefix-cache blocks); `pinned`: blocks held by finished
    requests for a transfer (decode: kept for the next turn's pull); `pinned_requests`:
    how many such requests."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    pinned: set[int] = set()
    pinned_requests = 0
    for request_id, request in scheduler.requests.items():
        if not request.is_finished():
            continue
        pinned_requests += 1
        for group in manager.get_block_ids(request_id):
            pinned.update(b for b in group if b)
    return {
        "total": int(pool.num_gpu_blocks) - 1,
        "free": int(pool.get_num_free_blocks()),
        "pinned": len(pinned),
        "pinned_requests": pinned_requests,
    }


def _engine_core_kv_blocks(core) -> dict[str, int]:
    return block_counts(core.scheduler)
