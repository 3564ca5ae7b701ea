"""Hugging Face folders through convert -> reshard -> restore, back into from_pretrained."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoint_helpers import assert_same_tensors
from safetensors.torch import load_model

from yafsdp_cli.checkpoint import convert_checkpoint, reshard_checkpoint, restore_checkpoint
from yafsdp_cli.options import LayoutOptions

tf = pytest.importorskip("transformers")
from hf_models import tiny_model  # noqa: E402

pytestmark = pytest.mark.hf


def tiny(name: str):
    model = tiny_model(name)
    return model.to(torch.bfloat16) if name == "llama" else model


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_hf_folder_round_trip_loads_with_from_pretrained(tmp_path, name):
    torch.manual_seed(0)
    model = tiny(name)
    model.save_pretrained(tmp_path / "src")
    flat = tmp_path / "flat"
    result = convert_checkpoint(
        tmp_path / "src",
        flat,
        LayoutOptions(filters=["linear", "embedding"], world_size=2),
        sharded=True,
    )
    assert result.source_kind == "hf" and result.checkpoint.kept  # norms kept as they are
    resharded = tmp_path / "flat3.safetensors"
    reshard_checkpoint(flat, resharded, world_size=3)
    back = tmp_path / "back"
    back.mkdir()
    restore_checkpoint(resharded, back / "model.safetensors")
    shutil.copy(tmp_path / "src" / "config.json", back)
    reloaded = type(model).from_pretrained(back)
    assert_same_tensors(model.state_dict(), reloaded.state_dict())
    fresh = tiny(name)  # and plain safetensors.torch.load_model, ties included
    assert load_model(fresh, str(back / "model.safetensors")) == (set(), [])
    assert_same_tensors(model.state_dict(), fresh.state_dict())
