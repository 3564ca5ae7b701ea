"""``restore --format dcp`` writes, without torch, what torch's own ``dcp.save`` writes for
the same state: every .distcp file byte for byte, and the same metadata."""

from __future__ import annotations

import filecmp
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_samples import save_dcp, training_checkpoint

from yafsdp_cli.checkpoint import convert_checkpoint, open_flat, restore_checkpoint
from yafsdp_cli.checkpoint.restore.read_back import (
    extras_of,
    nest,
    read_tensor,
    state_dict_items,
    training_items,
)
from yafsdp_cli.options import LayoutOptions


def torch_writes(ckpt, out: Path) -> None:
    """The same state as ``restore --format dcp`` writes, saved by torch's ``dcp.save``
    with a writer of one file per item (real tensors read from the flat checkpoint)."""
    items = state_dict_items(ckpt)
    if ckpt.optim is None:
        values = {(n,): read_tensor(it) for it in items for n in (it.slot.name, *it.aliases)}
    else:
        values = {path: read_tensor(it) for path, it in training_items(ckpt, items).items()}
        values.update(extras_of(ckpt.optim))
    writer = dcp.FileSystemWriter(out, single_file_per_rank=False, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(nest(values), storage_writer=writer, no_dist=True)


def assert_same_folder(ours: Path, theirs: Path) -> None:
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in theirs.iterdir())
    for name in names:
        if name != ".metadata":
            assert filecmp.cmp(ours / name, theirs / name, shallow=False), name
    a, b = (pickle.loads((p / ".metadata").read_bytes()) for p in (ours, theirs))
    assert list(a.state_dict_metadata.items()) == list(b.state_dict_metadata.items())
    assert list(a.storage_data.items()) == list(b.storage_data.items())
    assert (a.planner_data, a.version) == (b.planner_data, b.version)
    # storage_meta names the folder written and a random save id; the folder's own name
    assert a.storage_meta.checkpoint_id == ours and a.storage_meta.load_id is None


@pytest.mark.parametrize("nested", [True, False])
def test_a_training_checkpoint_is_what_dcp_save_writes(tmp_path, nested):
    training_checkpoint(tmp_path / "src", "gpt", nested=nested)
    convert_checkpoint(
        tmp_path / "src", tmp_path / "flat", LayoutOptions(world_size=3), sharded=True
    )
    restore_checkpoint(tmp_path / "flat", tmp_path / "ours", fmt="dcp")
    torch_writes(open_flat(tmp_path / "flat"), tmp_path / "theirs")
    assert_same_folder(tmp_path / "ours", tmp_path / "theirs")


def test_weights_of_every_dtype(tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "d": torch.empty(0, 2),
        "e": torch.tensor(1.5, dtype=torch.float64),
    }
    save_dcp(tmp_path / "src", state)
    convert_checkpoint(tmp_path / "src", tmp_path / "flat.safetensors", LayoutOptions(world_size=2))
    restore_checkpoint(tmp_path / "flat.safetensors", tmp_path / "ours", fmt="dcp")
    torch_writes(open_flat(tmp_path / "flat.safetensors"), tmp_path / "theirs")
    assert_same_folder(tmp_path / "ours", tmp_path / "theirs")


def test_tied_weights_are_each_written(tmp_path):
    convert_checkpoint(
        "sample_models/gpt.safetensors", tmp_path / "flat.safetensors", LayoutOptions(world_size=2)
    )
    restore_checkpoint(tmp_path / "flat.safetensors", tmp_path / "ours", fmt="dcp")
    torch_writes(open_flat(tmp_path / "flat.safetensors"), tmp_path / "theirs")
    assert_same_folder(tmp_path / "ours", tmp_path / "theirs")
