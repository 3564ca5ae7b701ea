"""The real thing: a tiny Hugging Face Llama trained under FSDP2 (``fully_shard``,
gloo, 2 processes) and saved with ``dcp.save``; yafsdp inspects, converts and
restores it; FSDP2 on 1 and 3 processes loads the result, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import assert_same_tensors, load_st
from dcp_samples import load_dcp_tensors
from typer.testing import CliRunner

from yafsdp_cli.cli import app

pytest.importorskip("transformers")
from dcp_helpers import launch, load_and_gather, tiny_llama, train_and_save  # noqa: E402

runner = CliRunner()
FACTORY = "tests/dcp_helpers.py:tiny_llama"


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One launch of 2 ranks: the nested and top-level saves and the reference."""
    out = tmp_path_factory.mktemp("fsdp2")
    launch(train_and_save, 2, str(out))
    return out, torch.load(out / "reference.pt")


@pytest.fixture(scope="module")
def restored(saved):
    """The nested save through yafsdp: DCP -> flat (world size 4) -> DCP."""
    out, _ = saved
    run("convert", out / "nested", "-o", out / "flat.safetensors", "-n", "4", "--verify")
    run("restore", out / "flat.safetensors", "-o", out / "restored", "--format", "dcp")
    return out / "restored"


def test_inspect_reads_what_fsdp2_saved(saved):
    out, reference = saved
    for layout in ("nested", "top"):
        doc = json.loads(run("inspect", out / layout, "--json", "-n", "2").stdout)
        entries = {e["name"]: e for b in doc["buffers"] for e in b["entries"]}
        assert sorted(entries) == sorted(reference), layout
        for name, t in reference.items():
            assert entries[name]["shape"] == list(t.shape), name
        state = doc["checkpoint_state"]["checkpoint"]
        assert state["files"] == 2 and state["optimizer_kind"] == "adamw"
        assert state["model_key"] == ("model" if layout == "nested" else None)
    # with the architecture the tie is known, and AdamW's states are what the model counts
    doc = json.loads(run("inspect", out / "nested", "--model", FACTORY, "--json").stdout)
    unique = sum(p.numel() for p in tiny_llama().parameters())  # a tied weight once
    state = doc["checkpoint_state"]
    assert state["measured_state_bytes"] == state["modeled_state_bytes"] == 2 * 4 * unique
    assert doc["params"]["total_numel"] == unique


def test_convert_and_restore_are_bit_exact(saved, restored, tmp_path):
    out, reference = saved
    run("restore", out / "flat.safetensors", "-o", tmp_path / "back.safetensors")
    assert_same_tensors(load_st(tmp_path / "back.safetensors"), reference)
    assert_same_tensors(load_dcp_tensors(restored, reference), reference)
    # DCP -> flat -> DCP: the same bytes as what FSDP2 saved (the top-level save)
    assert_same_tensors(
        load_dcp_tensors(restored, reference), load_dcp_tensors(out / "top", reference)
    )
    run("verify", out / "nested", "--model", FACTORY, "--steps", "1")


@pytest.mark.parametrize("world", [1, 3])
def test_fsdp2_loads_the_restored_checkpoint(saved, restored, world, tmp_path):
    _, reference = saved
    launch(load_and_gather, world, str(restored), str(tmp_path / "loaded.pt"))
    assert_same_tensors(torch.load(tmp_path / "loaded.pt"), reference)


def test_a_hugging_face_config_beside_dcp_weights(saved, tmp_path):
    """config.json + a DCP checkpoint: the architecture from the config (so the tie
    is known), the weights from the checkpoint."""
    import shutil

    out, reference = saved
    folder = tmp_path / "hf"
    shutil.copytree(out / "nested", folder)
    tiny_llama().config.save_pretrained(folder)
    doc = json.loads(run("inspect", folder, "--json").stdout)
    assert doc["source_kind"] == "hf" and doc["has_architecture"]
    assert doc["params"]["shared"] == [
        {"name": "model.embed_tokens.weight", "aliases": ["lm_head.weight"]}
    ]
    run("convert", folder, "-o", tmp_path / "flat.safetensors", "--verify")
    run("restore", tmp_path / "flat.safetensors", "-o", tmp_path / "back.safetensors")
    back = load_st(tmp_path / "back.safetensors")  # the tie stored once, as save_model does
    assert_same_tensors(back, {k: v for k, v in reference.items() if k != "lm_head.weight"})
