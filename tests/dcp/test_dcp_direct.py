"""DCP folders read without torch: chunk bytes found in their .distcp files and copied
by range, equal to what torch's own reader gives; the layouts left to torch's reader;
hostile chunks refused with one line; convert, reshard and restore never import torch."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import ROOT
from dcp_samples import load_dcp_tensors, save_dcp, trained
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source

runner = CliRunner()


def saved(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def crafted(folder: Path, tensors: dict[str, tuple[torch.Tensor, list]]) -> Path:
    """A DCP folder by hand: each tensor's chunks ``(offsets, what torch.save saves)``
    one after the other in one .distcp file, as ranks' shards are."""
    folder.mkdir()
    blob, sd_md, storage = b"", {}, {}
    for fqn, (whole, chunks) in tensors.items():
        meta_chunks = []
        for offsets, part in chunks:
            data = saved(part)
            index = MetadataIndex(fqn, offsets)
            storage[index] = _StorageInfo("__0_0.distcp", len(blob), len(data))
            meta_chunks.append(ChunkStorageMetadata(torch.Size(offsets), part.shape))
            blob += data
        props = TensorProperties(dtype=whole.dtype)
        sd_md[fqn] = TensorStorageMetadata(props, whole.shape, meta_chunks)
    (folder / "__0_0.distcp").write_bytes(blob)
    planner = {fqn: (fqn,) for fqn in tensors}
    md = Metadata(sd_md, planner_data=planner, storage_data=storage)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder


def test_chunks_read_directly_or_by_torch_equal_the_tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(7, 4, generator=g) for _ in range(3))
    big = torch.randn(10, 4, generator=g)
    tensors = {
        "rows": (a, [((0, 0), a[:4].clone()), ((4, 0), a[4:].clone())]),  # FSDP's shards
        "view": (big[2:5], [((0, 0), big[2:5])]),  # saved with the whole storage, offset 8
        "param": (c, [((0, 0), torch.nn.Parameter(c))]),
        "cols": (b, [((0, 0), b[:, :2].clone()), ((0, 2), b[:, 2:].clone())]),  # torch's
        "transposed": (b.t(), [((0, 0), b.t())]),  # not one run of bytes: torch's reader
    }
    crafted(tmp_path / "ck", tensors)
    reader = load_source(tmp_path / "ck").reader
    direct = {n: reader.pieces(n) is not None for n in tensors}
    assert direct == {"rows": True, "view": True, "param": True, "cols": False, "transposed": False}
    by_torch = load_dcp_tensors(tmp_path / "ck", {n: w for n, (w, _) in tensors.items()})
    for name, (whole, _) in tensors.items():
        assert torch.equal(reader.load(name), whole) and torch.equal(by_torch[name], whole), name
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back.safetensors"
    assert (
        runner.invoke(app, ["convert", str(tmp_path / "ck"), "-o", str(flat), "-n", "3"]).exit_code
        == 0
    )
    assert runner.invoke(app, ["restore", str(flat), "-o", str(back)]).exit_code == 0
    for name, t in load_file(str(back)).items():
        assert torch.equal(t, tensors[name][0].contiguous()), name


# ------------------------------------------------------------ hostile chunks


@pytest.fixture
def ck(tmp_path):
    """A torchtitan-style checkpoint of the sample MLP after one AdamW step."""
    model, opt = trained("mlp")
    save_dcp(
        tmp_path / "ck",
        {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)},
    )
    return tmp_path / "ck"


def _edit(folder: Path, fqn: str, edit) -> None:
    """Apply ``edit(info, file bytes) -> (new info fields, new file bytes)`` to the
    storage record of ``fqn``'s chunk."""
    md = pickle.loads((folder / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == fqn)
    data = folder / info.relative_path
    info.offset, info.length, blob = edit(info, data.read_bytes())
    data.write_bytes(blob)
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _append(obj):
    """Point the record at a torch.save of ``obj`` appended to the file."""

    def edit(info, blob):
        extra = saved(obj)
        return len(blob), len(extra), blob + extra

    return edit


def refused(folder: Path, match: str) -> None:
    out = folder.parent / "out"
    result = runner.invoke(app, ["convert", str(folder), "-o", str(out), "-n", "2", "--sharded"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    assert __import__("re").search(match, lines[0]), lines[0]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ck"]  # nothing left behind


W = "model.net.0.weight"  # (128, 64) float32


def test_a_truncated_member(ck):
    _edit(ck, W, lambda info, blob: (info.offset, info.length - 60, blob))
    refused(ck, rf"reading '{W}' failed \(.*no zip end record where the archive should end")


def test_lying_offsets(ck):
    _edit(ck, W, lambda info, blob: (info.offset + 16, info.length - 16, blob))
    refused(ck, rf"reading '{W}' failed \(.*zip directory is damaged")


def test_a_wrong_dtype_or_shape_in_data_pkl(ck, tmp_path):
    weight = torch.zeros(128, 64)
    _edit(ck, W, _append(weight.double()))
    refused(ck, r"holds a float64\[128, 64\] tensor, but the metadata says float32\[128, 64\]")
    _edit(ck, W, _append(weight[:100]))
    refused(ck, r"holds a float32\[100, 64\] tensor, but the metadata says float32\[128, 64\]")


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED",))


def test_a_pickle_global_outside_the_allow_list(ck, tmp_path, monkeypatch):
    """Not torch.save's plain-tensor vocabulary: left to torch.load(weights_only=True),
    which refuses it, as it always did."""
    monkeypatch.chdir(tmp_path)
    _edit(ck, W, _append(_Payload()))
    refused(ck, rf"reading {W} failed .*Weights only load failed")
    assert not (tmp_path / "PWNED").exists()


def test_corrupt_state_bytes_fail_their_crc(ck):
    fqn = "optimizer.state.net.0.weight.exp_avg"

    def flip(info, blob):
        blob = bytearray(blob)
        blob[info.offset + info.length // 2] ^= 0x40  # inside the 32 KiB data member
        return info.offset, info.length, bytes(blob)

    _edit(ck, fqn, flip)
    refused(ck, r"__0_0.distcp at byte \d+: archive/data/0 fails its CRC-32")


# ------------------------------------------------------------ torch never imported

_RUN = """
import json, sys
sys.argv = ["yafsdp", *sys.argv[1:]]
from yafsdp_cli.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}), file=sys.stderr)
"""


def yafsdp_without_torch(*args) -> None:
    """Run the CLI in a fresh interpreter; it must succeed without importing torch."""
    done = subprocess.run(
        [sys.executable, "-c", _RUN, *map(str, args), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "torch": False}, done.stderr


def test_convert_reshard_restore_of_a_training_checkpoint_never_import_torch(tmp_path):
    """torchtitan's checkpoint through every command, bit for bit, loaded back the way
    torchtitan loads it; no command imports torch."""
    model, opt = trained("gpt", steps=2)
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    save_dcp(tmp_path / "step-2", state)
    yafsdp_without_torch(
        "convert", tmp_path / "step-2", "-o", tmp_path / "f4", "-n", "4", "--sharded"
    )
    yafsdp_without_torch("reshard", tmp_path / "f4", "-n", "3", "--sharded", "-o", tmp_path / "f3")
    yafsdp_without_torch("restore", tmp_path / "f3", "-o", tmp_path / "back", "--format", "dcp")
    yafsdp_without_torch("inspect", tmp_path / "back")
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "back")).read_metadata()  # torch's own reader
    assert set(md.state_dict_metadata) == set(
        pickle.loads((tmp_path / "step-2" / ".metadata").read_bytes()).state_dict_metadata
    )
    fresh, fresh_opt = trained("gpt", steps=0)
    fresh_opt.step()  # an optimizer with state to load into, as torchtitan's has
    loaded = {"model": fresh.state_dict(), "optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for name, t in state["model"].items():
        assert torch.equal(loaded["model"][name], t), name
    for param, fields in state["optimizer"]["state"].items():
        for field, t in fields.items():
            assert torch.equal(loaded["optimizer"]["state"][param][field], t), (param, field)
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
