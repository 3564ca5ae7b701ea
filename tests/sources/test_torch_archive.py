"""torch.save archives and DCP's metadata pickle without torch: what yafsdp reads and
writes is what torch itself reads and writes, byte for byte where torch is deterministic."""

from __future__ import annotations

import io
import math
import pickle
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from yafsdp_cli import SourceError
from yafsdp_cli.sources import dcp_pickle as dp
from yafsdp_cli.sources import torch_archive as ta
from yafsdp_cli.sources import torch_pickle as tp

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.uint16)  # fmt: skip


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_archive(path: Path, pickled: bytes, storages: list[bytes]) -> None:
    """An archive as ``checkpoint.dcp_write`` lays one out, from bytes in memory."""
    members = ta.torch_members([(str(k), len(s)) for k, s in enumerate(storages)], len(pickled))
    arch = ta.ArchiveWriter(members)
    contents = {
        "data.pkl": pickled,
        ".format_version": ta.FORMAT_VERSION,
        ".storage_alignment": ta.STORAGE_ALIGNMENT,
        "byteorder": ta.BYTEORDER,
        "version": ta.VERSION,
        **{f"data/{k}": s for k, s in enumerate(storages)},
    }
    crcs = {name: zlib.crc32(contents[name]) for name in arch.records}
    contents[ta.SERIALIZATION_ID] = ta.serialization_id(crcs, arch.sizes)
    crcs[ta.SERIALIZATION_ID] = zlib.crc32(contents[ta.SERIALIZATION_ID])
    out = bytearray(arch.nbytes)
    for offset, data in [*arch.headers(), *arch.trailer(crcs)]:
        out[offset : offset + len(data)] = data
    for name, data in contents.items():
        out[arch.data_at(name) : arch.data_at(name) + len(data)] = data
    path.write_bytes(bytes(out))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 4), (0, 4), ()], ids=str)
def test_a_tensor_archive_is_torch_saves_byte_for_byte(tmp_path, dtype, shape):
    t = torch.arange(math.prod(shape)).reshape(shape).to(dtype)
    theirs = torch_saved(t)
    pickled = tp.tensor_pickle(t, {id(t): (str(dtype)[6:], shape)})
    assert pickled == zipfile.ZipFile(io.BytesIO(theirs)).read("archive/data.pkl")
    write_archive(tmp_path / "a.pt", pickled, [raw(t)])
    assert (tmp_path / "a.pt").read_bytes() == theirs  # the serialization id included
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True), t)


@pytest.mark.parametrize("value", [1.5, ["a", "b"], (0.9, 0.999), {"lr": 1e-3, "x": [None, True]}])
def test_a_value_archive_is_torch_saves_byte_for_byte(tmp_path, value):
    write_archive(tmp_path / "v.pt", tp.tensor_pickle(value, {}), [])
    assert (tmp_path / "v.pt").read_bytes() == torch_saved(value)


def test_reading_torch_saves_archive_finds_each_member(tmp_path):
    t = torch.randn(5, 7)
    data = b"junk" * 10 + torch_saved(t)  # at an offset inside a file, as in a .distcp
    (tmp_path / "f").write_bytes(data + b"tail")
    arch = ta.read_archive(tmp_path / "f", 40, len(data) - 40, "f")
    m = arch.members["data/0"]
    assert arch.prefix == "archive" and m.offset % ta.ALIGNMENT == 40 % ta.ALIGNMENT
    assert data[m.offset : m.offset + m.nbytes] == raw(t) and m.crc == zlib.crc32(raw(t))
    ref = tp.load_pickle(arch.read("data.pkl", 1 << 20, "f"))
    assert (ref.dtype, ref.shape, ref.stride, ref.offset) == ("float32", (5, 7), (7, 1), 0)


def test_zip64_fields_read_by_torch_and_zipfile(tmp_path, monkeypatch):
    """Members past 4 GiB need zip64 fields; forced here for a small archive."""
    monkeypatch.setattr(ta, "ZIP64_LIMIT", 0)
    t = torch.randn(5, 7)
    write_archive(tmp_path / "z.pt", tp.tensor_pickle(t, {id(t): ("float32", (5, 7))}), [raw(t)])
    assert torch.equal(torch.load(tmp_path / "z.pt", weights_only=True), t)
    assert zipfile.ZipFile(tmp_path / "z.pt").testzip() is None
    size = (tmp_path / "z.pt").stat().st_size
    m = ta.read_archive(tmp_path / "z.pt", 0, size, "z").members["data/0"]
    assert (tmp_path / "z.pt").read_bytes()[m.offset : m.offset + m.nbytes] == raw(t)


def test_views_and_parameters_in_data_pkl():
    base = torch.arange(20.0).reshape(4, 5)
    view = tp.load_pickle(
        zipfile.ZipFile(io.BytesIO(torch_saved(base[1:3]))).read("archive/data.pkl")
    )
    assert (view.offset, view.shape, view.storage.numel) == (5, (2, 5), 20)
    assert view.byte_range(80) == (20, 40)
    col = tp.load_pickle(
        zipfile.ZipFile(io.BytesIO(torch_saved(base[:, 1]))).read("archive/data.pkl")
    )
    with pytest.raises(ta.NeedsTorchError):  # a column: not one run of bytes
        col.byte_range(80)
    param = torch_saved(torch.nn.Parameter(torch.ones(3)))
    assert tp.load_pickle(zipfile.ZipFile(io.BytesIO(param)).read("archive/data.pkl")).shape == (3,)


def test_a_global_outside_torch_saves_vocabulary_is_not_read():
    class Payload:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    with pytest.raises(ta.NeedsTorchError, match="names (posix|os).system"):
        tp.load_pickle(pickle.dumps(Payload(), protocol=2))


def test_damaged_archives_are_refused(tmp_path):
    data = torch_saved(torch.randn(4))
    (tmp_path / "a").write_bytes(data)
    with pytest.raises(SourceError, match="no zip end record"):
        ta.read_archive(tmp_path / "a", 0, len(data) - 10, "a")  # a truncated range
    with pytest.raises(SourceError, match="the zip directory is damaged"):
        ta.read_archive(tmp_path / "a", 8, len(data) - 8, "a")  # a lying offset
    bad = bytearray(data)
    m = ta.read_archive(tmp_path / "a", 0, len(data), "a").members["data.pkl"]
    bad[m.offset + 3] ^= 0xFF
    (tmp_path / "b").write_bytes(bytes(bad))
    with pytest.raises(SourceError, match="fails its CRC-32"):
        ta.read_archive(tmp_path / "b", 0, len(data), "b").read("data.pkl", 1 << 20, "b")


def test_every_torch_dtype_name_is_known():
    names = {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert names <= tp.TORCH_DTYPES, sorted(names - tp.TORCH_DTYPES)


def test_metadata_read_as_stand_ins_and_written_back_as_torchs(tmp_path):
    from dcp_samples import save_dcp

    save_dcp(tmp_path, {"w": torch.randn(3, 2), "opt": {"lr": 0.1}})
    blob = (tmp_path / ".metadata").read_bytes()
    md = dp.MetadataUnpickler(io.BytesIO(blob), "m").load()
    assert type(md) is dp.Metadata and md.state_dict_metadata["w"].size == (3, 2)
    buf = io.BytesIO()
    dp.dump_metadata(md, buf)
    assert pickle.loads(buf.getvalue()) == pickle.loads(blob)  # torch's classes, equal
