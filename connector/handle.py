"""The typed wire of vLLM's NixlConnector: `kv_transfer_params` parsed once, here.

vLLM passes transfer metadata between engines as a loose dict (`kv_transfer_params`).
This module is the only place that reads or writes its keys. Everything else in the
project holds a `KVHandle`: a frozen description of KV blocks pinned on one engine,
which another engine can read over NIXL exactly once.

Two directions use the same shape:

* `Location.PREFILL`: blocks a prefill engine computed for a prompt; the decode engine
  reads them (the classic P -> D hop).
* `Location.DECODE`: blocks a decode engine holds after a turn (prompt + answer) with
  bi-directional transfer on; the next turn's prefill reads them (D -> P).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

_REQUIRED = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)


class Location(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class WireError(ValueError):
    """Transfer params from an engine that do not describe readable blocks."""


@dataclass(frozen=True)
class KVHandle:
    """KV blocks pinned on one engine, readable once by a peer over NIXL.

    `num_tokens` is how many leading positions of the owner's token sequence the blocks
    hold. It may be lowered (`capped`) to the verified common prefix of the next prompt;
    it is never raised.
    """

    location: Location
    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    host: str
    port: int
    num_tokens: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    transfer_mode: str | None = None
    cache_salt: str | None = None
    """The cache salt the blocks were computed under (set by the ingress, never on the
    wire): an engine that takes them over (`move_params`) caches them under it too."""

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.block_ids)

    def capped(self, num_tokens: int, block_size: int) -> KVHandle:
        """The leading blocks that hold the first `num_tokens` positions, and no others.

        The block list must shrink with the token count: a reader aligns the owner's
        blocks to its own from the END of the list (it assumes its prefix cache holds
        the head), so a list longer than the positions read would pair the reader's
        blocks with the owner's later blocks and load the wrong KV.
        """
        num_tokens = max(0, min(self.num_tokens, num_tokens))
        keep = -(-num_tokens // block_size)
        return replace(
            self,
            num_tokens=num_tokens,
            block_ids=tuple(group[:keep] for group in self.block_ids),
        )

    @classmethod
    def from_wire(cls, params: Mapping[str, Any] | None) -> KVHandle:
        """Parse an engine's final `kv_transfer_params`.

        Raises `WireError` if the params do not describe pinned blocks (e.g. the engine
        freed them, or the request was aborted).
        """
        if not params:
            raise WireError("engine returned no kv_transfer_params")
        missing = [key for key in _REQUIRED if params.get(key) is None]
        if missing:
            raise WireError(f"kv_transfer_params lack {', '.join(missing)}")
        if params.get("do_remote_prefill"):
            location = Location.PREFILL
        elif params.get("do_remote_decode"):
            location = Location.DECODE
        else:
            raise WireError("kv_transfer_params name no transfer direction")
        groups = params["remote_block_ids"]
        if groups and not isinstance(groups[0], (list, tuple)):
            groups = [groups]
        block_ids = tuple(tuple(int(b) for b in group) for group in groups)
        if not any(block_ids):
            raise WireError("kv_transfer_params hold no blocks")
        return cls(
            location=location,
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            block_ids=block_ids,
            host=str(params["remote_host"]),
            port=int(params["remote_port"]),
            num_tokens=int(params.get("remote_num_tokens") or 0),
            tp_size=int(params.get("tp_size") or 1),
            dcp_size=int(params.get("dcp_size") or 1),
            pp_size=int(params.get("pp_size") or 1),
            transfer_mode=params.get("transfer_mode"),
        )

    def to_wire(self) -> dict[str, Any]:
        """Params for the engine that reads these blocks.

        A PREFILL handle goes to a decode engine (read the prompt's KV, then decode).
        A DECODE handle goes to a prefill engine (read the history, compute the rest,
        keep the result for the next decode engine).
        """
        reader_is_decode = self.location is Location.PREFILL
        params: dict[str, Any] = {
            "do_remote_prefill": reader_is_decode,
            "do_remote_decode": not reader_is_decode,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(group) for group in self.block_ids],
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_num_tokens": self.num_tokens,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
        }
        if self.transfer_mode is not None:
            params["transfer_mode"] = self.transfer_mode
        return params


def move_params(handle: KVHandle) -> dict[str, Any]:
    """Params for a decode engine that takes over a peer decode engine's blocks (the peer
    is stopping): it reads them as it reads a prefill engine's, then, like every decode
    request, pins its own copy for the next turn's pull. The peer frees its blocks once
    read, as after any pull."""
    if handle.location is not Location.DECODE:
        raise WireError("only blocks held by a decode engine are moved")
    return replace(handle, location=Location.PREFILL).to_wire()


def first_leg_params() -> dict[str, Any]:
    """Params for a prefill request with nothing to read: compute, then keep the blocks
    for a decode engine."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def local_decode_params() -> dict[str, Any]:
    """Params for a decode request that computes its prompt itself (over its own prefix
    cache, nothing to read) and, like every decode request, keeps its blocks for the next
    turn's pull: its final output carries the handle."""
    return {"do_remote_prefill": False, "do_remote_decode": False}


def prefill_params(history: KVHandle | None) -> dict[str, Any]:
    """Params for the prefill leg of a turn: read `history` from its decode engine if
    given, otherwise compute everything."""
    if history is None:
        return first_leg_params()
    if history.location is not Location.DECODE:
        raise WireError("prefill can only read history held by a decode engine")
    return history.to_wire()
