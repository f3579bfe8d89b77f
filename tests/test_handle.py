"""`connector.handle`: the typed wire of vLLM's `kv_transfer_params`."""

from __future__ import annotations

import pytest

from connector.handle import (
    KVHandle,
    Location,
    WireError,
    first_leg_params,
    prefill_params,
)

# What a decode engine returns after a turn with bi-directional transfer on: its blocks
# (prompt + answer) are pinned for the next turn's prefill to read.
BLOCK = 128  # DECODE_SIDE: 309 positions in 3 blocks

DECODE_SIDE = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "d-1",
    "remote_request_id": "r",
    "remote_host": "10.0.0.2",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 309,
    "remote_blocks_expiry_time": 999.1,
    "transfer_mode": "pull",
}

# What a prefill engine returns for a request sent with do_remote_decode: the prompt's
# blocks, pinned for a decode engine.
PREFILL_SIDE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[7, 8], [9]],
    "remote_engine_id": "p-0",
    "remote_request_id": "chatcmpl-1-prefill",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
}


def test_from_wire_decode_side():
    h = KVHandle.from_wire(DECODE_SIDE)
    assert h.location is Location.DECODE
    assert h.engine_id == "d-1"
    assert h.request_id == "r"
    assert h.block_ids == ((1, 2, 3),)
    assert h.num_blocks == 3
    assert (h.host, h.port) == ("10.0.0.2", 5601)
    assert h.num_tokens == 309
    assert (h.tp_size, h.dcp_size, h.pp_size) == (1, 1, 1)
    assert h.transfer_mode == "pull"


def test_from_wire_prefill_side():
    h = KVHandle.from_wire(PREFILL_SIDE)
    assert h.location is Location.PREFILL
    assert h.engine_id == "p-0"
    assert h.request_id == "chatcmpl-1-prefill"
    assert h.block_ids == ((7, 8), (9,))
    assert h.num_blocks == 3
    assert h.num_tokens == 70
    assert h.tp_size == 2
    assert h.transfer_mode is None


def test_from_wire_flat_block_list_is_one_group():
    h = KVHandle.from_wire({**DECODE_SIDE, "remote_block_ids": [4, 5]})
    assert h.block_ids == ((4, 5),)


def test_from_wire_missing_optional_fields_default():
    params = {
        k: v
        for k, v in DECODE_SIDE.items()
        if k not in ("tp_size", "dcp_size", "pp_size", "remote_num_tokens", "transfer_mode")
    }
    h = KVHandle.from_wire(params)
    assert (h.tp_size, h.dcp_size, h.pp_size, h.num_tokens, h.transfer_mode) == (1, 1, 1, 0, None)


def test_decode_handle_to_wire_is_for_prefill():
    """A DECODE handle is read by a prefill engine: it asks prefill to pull the history
    and keep its own result for a decode engine (do_remote_decode)."""
    wire = KVHandle.from_wire(DECODE_SIDE).to_wire()
    assert wire["do_remote_decode"] is True
    assert wire["do_remote_prefill"] is False
    assert wire["remote_engine_id"] == "d-1"
    assert wire["remote_request_id"] == "r"
    assert wire["remote_block_ids"] == [[1, 2, 3]]
    assert wire["remote_host"] == "10.0.0.2"
    assert wire["remote_port"] == 5601
    assert wire["remote_num_tokens"] == 309
    assert wire["transfer_mode"] == "pull"
    # Engine-private keys are not echoed back.
    assert "remote_blocks_expiry_time" not in wire


def test_prefill_handle_to_wire_is_for_decode():
    wire = KVHandle.from_wire(PREFILL_SIDE).to_wire()
    assert wire["do_remote_prefill"] is True
    assert wire["do_remote_decode"] is False
    assert wire["remote_block_ids"] == [[7, 8], [9]]
    assert wire["tp_size"] == 2
    assert "transfer_mode" not in wire


@pytest.mark.parametrize("params", [DECODE_SIDE, PREFILL_SIDE])
def test_round_trip(params):
    """The reader's params carry the same flags the owner returned (decode-side output
    and a prefill request that reads history both set do_remote_decode), so parsing them
    gives back the same handle."""
    h = KVHandle.from_wire(params)
    assert KVHandle.from_wire(h.to_wire()) == h
    capped = h.capped(10, BLOCK)
    assert KVHandle.from_wire(capped.to_wire()) == capped


@pytest.mark.parametrize(
    "params, message",
    [
        (None, "no kv_transfer_params"),
        ({}, "no kv_transfer_params"),
        ({**DECODE_SIDE, "remote_block_ids": None}, "remote_block_ids"),
        ({**DECODE_SIDE, "remote_engine_id": None}, "remote_engine_id"),
        ({k: v for k, v in DECODE_SIDE.items() if k != "remote_host"}, "remote_host"),
        ({k: v for k, v in DECODE_SIDE.items() if k != "remote_port"}, "remote_port"),
        ({**DECODE_SIDE, "do_remote_decode": False}, "no transfer direction"),
        ({**DECODE_SIDE, "remote_block_ids": []}, "no blocks"),
        ({**DECODE_SIDE, "remote_block_ids": [[]]}, "no blocks"),
        (first_leg_params(), "lack"),
    ],
)
def test_wire_errors(params, message):
    with pytest.raises(WireError, match=message):
        KVHandle.from_wire(params)


def test_wire_error_is_value_error():
    assert issubclass(WireError, ValueError)


@pytest.mark.parametrize(
    "cap, expected, blocks",
    [
        (0, 0, ()),
        (-5, 0, ()),
        (100, 100, (1,)),
        (128, 128, (1,)),
        (129, 129, (1, 2)),
        (308, 308, (1, 2, 3)),
        (309, 309, (1, 2, 3)),
        (310, 309, (1, 2, 3)),
        (10_000, 309, (1, 2, 3)),
    ],
)
def test_capped_never_raises_and_keeps_only_leading_blocks(cap, expected, blocks):
    h = KVHandle.from_wire(DECODE_SIDE)
    c = h.capped(cap, BLOCK)
    assert c.num_tokens == expected
    # Only the blocks holding the kept positions remain: a reader aligns the owner's
    # list to its own from the end, so extra trailing blocks would load the wrong KV.
    assert c.block_ids == (blocks,) and c.engine_id == h.engine_id
    assert h.num_tokens == 309 and h.block_ids == ((1, 2, 3),)  # frozen: the original is unchanged


def test_capped_twice_cannot_grow_back():
    h = KVHandle.from_wire(DECODE_SIDE).capped(50, BLOCK)
    assert h.capped(200, BLOCK).num_tokens == 50
    assert h.to_wire()["remote_num_tokens"] == 50


def test_prefill_params_none_is_first_leg():
    params = prefill_params(None)
    assert params == first_leg_params()
    assert params["do_remote_decode"] is True
    assert params["do_remote_prefill"] is False
    for key in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"):
        assert params[key] is None


def test_prefill_params_reads_decode_history():
    h = KVHandle.from_wire(DECODE_SIDE).capped(120, BLOCK)
    params = prefill_params(h)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_num_tokens"] == 120
    assert params["remote_engine_id"] == "d-1"


def test_prefill_params_refuses_prefill_handle():
    with pytest.raises(WireError):
        prefill_params(KVHandle.from_wire(PREFILL_SIDE))
