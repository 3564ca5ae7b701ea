"""Pickles that would make Python's C unpickler allocate out of all proportion are
refused by their opcodes, before any unpickler runs; real ones pass."""

from __future__ import annotations

import pickle
import struct
import time
import warnings

import pytest
import torch

from yafsdp_cli.sources.pickle_guard import PickleShapeError, check_pickle


def _with_memo_index(index: int) -> bytes:
    """A 30-byte protocol-4 pickle whose one ``LONG_BINPUT`` stores at ``index``."""
    return b"\x80\x04" + b"]" + b"r" + struct.pack("<I", index) + b"."


def _with_length(opcode: bytes, length: int) -> bytes:
    """A pickle whose ``opcode`` (BINBYTES8, BYTEARRAY8, BINUNICODE8) claims ``length``
    bytes and has 4."""
    return b"\x80\x05" + opcode + struct.pack("<Q", length) + b"abcd."


@pytest.mark.parametrize("index", [1, 1000, 1_298_491_233, 2**32 - 1])
def test_a_memo_index_past_the_entries_is_refused_at_once(index):
    start = time.perf_counter()
    with pytest.raises(PickleShapeError, match=f"memo index {index} after 0 entries"):
        check_pickle(_with_memo_index(index))
    assert time.perf_counter() - start < 0.1


def test_a_memo_index_in_order_passes():
    data = _with_memo_index(0)
    assert check_pickle(data) == 4 and pickle.loads(data) == []


@pytest.mark.parametrize("opcode", [b"\x8e", b"\x96", b"\x8d"])
def test_a_length_past_the_end_is_refused_before_allocation(opcode):
    with pytest.raises(PickleShapeError, match="bytes in|remain"):
        check_pickle(_with_length(opcode, 2**61))


def test_a_get_of_an_entry_never_stored_is_refused():
    data = b"\x80\x04" + b"]" + b"\x94" + b"j" + struct.pack("<I", 7) + b"\x86."
    with pytest.raises(PickleShapeError, match="memo index 7 read, of 1 entries"):
        check_pickle(data)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_protocol_of_pickle_passes(protocol):
    shared = ["x", ("y", 2)]
    obj = {"a": [shared, shared, list(range(300))], "b": b"\x00" * 300, "c": 1.5}
    data = pickle.dumps(obj, protocol=protocol)
    assert check_pickle(data) > 10 and pickle.loads(data) == obj


def test_torchs_own_dcp_metadata_passes(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert check_pickle((tmp_path / ".metadata").read_bytes()) > 20
