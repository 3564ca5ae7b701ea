"""Pickles that would make Python's C unpickler allocate out of all proportion are
refused by their opcodes, before any unpickler runs; real ones pass."""

from __future__ import annotations

import pickle
import struct
import time
import warnings
from pathlib import Path

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


# ------------------------------------------------ through the commands that read them


def _nested_key(depth: int) -> bytes:
    """A dict whose one key is a tuple nested ``depth`` deep: hashing it as the
    unpickler stores it recurses in C past the stack."""
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."


def _shared_key(levels: int) -> bytes:
    """A dict whose key is ``t = (t', t')`` over ``levels`` levels: 2**levels steps to hash."""
    body = b"".join(b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(levels))
    return b"\x80\x04}" + b")\x94" + body + b"K\x01s."


HOSTILE_METADATA = {
    "memo-index": _with_memo_index(1_298_491_233),
    "bytes-length": _with_length(b"\x96", 2**40),
    "nested-key": _nested_key(200_000),
    "shared-key": _shared_key(60),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_METADATA))
def test_a_hostile_dcp_metadata_is_refused_before_it_is_unpickled(tmp_path, name):
    """In a process of its own: without the check, "nested-key" ends it with a
    segmentation fault, "shared-key" never ends and "memo-index" zeroes 20 GB."""
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(HOSTILE_METADATA[name])
    root = Path(__file__).resolve().parents[2]
    code = "import sys; from yafsdp_cli.cli import console; sys.argv[0] = 'yafsdp'; console()"
    done = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-500:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {folder}/.metadata: not a "), lines
    assert "internal error" not in lines[0]


def test_a_pickled_value_in_a_distcp_file_is_checked_too():
    from yafsdp_cli.sources.torch_pickle import load_pickle

    with pytest.raises(PickleShapeError, match="nested more than 64 deep"):
        load_pickle(_nested_key(1000))


def _pt_with_pickle(path: Path, pickled: bytes) -> Path:
    """A ``torch.save`` zip archive whose data.pkl is replaced by ``pickled``."""
    import zipfile

    base = path.with_suffix(".base.pt")
    torch.save({"a": torch.ones(2)}, base)
    with zipfile.ZipFile(base) as z, zipfile.ZipFile(path, "w") as out:
        for name in z.namelist():
            out.writestr(name, pickled if name.endswith("data.pkl") else z.read(name))
    return path


@pytest.mark.parametrize("name", ["memo-index", "nested-key", "shared-key"])
def test_a_pt_file_whose_pickle_would_crash_torch_is_refused(tmp_path, name):
    """torch.load(weights_only=True) stores dict keys as it goes: a 200,000-deep tuple
    key is a segmentation fault there too, so the check runs first, in process."""
    from yafsdp_cli.errors import SourceError
    from yafsdp_cli.sources.torch_file import load_torch_file

    path = _pt_with_pickle(tmp_path / "m.pt", HOSTILE_METADATA[name])
    with pytest.raises(SourceError, match=r"m\.pt: not a readable torch file \((memo|a tuple)"):
        load_torch_file(path, trust_pickle=True)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_real_pt_file_of_either_format_passes(tmp_path, zipped):
    from yafsdp_cli.sources.torch_file import load_torch_file

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "key": (1, (2, 3))}
    torch.save(state, tmp_path / "m.pt", _use_new_zipfile_serialization=zipped)
    loaded, _ = load_torch_file(tmp_path / "m.pt", trust_pickle=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["key"] == (1, (2, 3))
