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
    """The nested save's weights through yafsdp: DCP -> flat (world size 4) -> DCP."""
    out, _ = saved
    run("convert", out / "nested", "-o", out / "flat.safetensors", "-n", "4", "--verify")
    run(
        "restore",
        out / "flat.safetensors",
        "-o",
        out / "restored",
        "--format",
        "dcp",
        "--weights-only",
    )
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
    back = tmp_path / "back.safetensors"
    run("restore", out / "flat.safetensors", "-o", back, "--weights-only")
    assert_same_tensors(load_st(back), reference)
    assert_same_tensors(load_dcp_tensors(restored, reference), reference)
    # DCP -> flat -> DCP: the same bytes as what FSDP2 saved (the top-level save)
    assert_same_tensors(
        load_dcp_tensors(restored, reference), load_dcp_tensors(out / "top", reference)
    )
    run("verify", out / "nested", "--model", FACTORY, "--steps", "1")


def test_the_whole_training_checkpoint_comes_back_in_its_nesting(saved, tmp_path):
    """What FSDP2 saved (model, AdamW state, train_state) -> flat (4 ranks) -> reshard
    (3) -> DCP: every tensor under its own key, bit for bit."""
    from yafsdp_cli.sources.dcp_meta import read_dcp_metadata

    out, _ = saved
    flat, re3, back = tmp_path / "flat", tmp_path / "re3", tmp_path / "back"
    run("convert", out / "nested", "-o", flat, "-n", "4", "--sharded")
    run("reshard", flat, "-n", "3", "--sharded", "-o", re3)
    run("restore", re3, "-o", back, "--format", "dcp")
    src, got = read_dcp_metadata(out / "nested"), read_dcp_metadata(back)
    assert set(got.tensors) == set(src.tensors) and set(got.non_tensors) == set(src.non_tensors)
    like = {k: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for k, t in src.tensors.items()}
    assert_same_tensors(load_dcp_tensors(back, like), load_dcp_tensors(out / "nested", like))


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
    run("convert", folder, "-o", tmp_path / "flat.safetensors", "--verify", "--weights-only")
    run("restore", tmp_path / "flat.safetensors", "-o", tmp_path / "back.safetensors")
    back = load_st(tmp_path / "back.safetensors")  # the tie stored once, as save_model does
    assert_same_tensors(back, {k: v for k, v in reference.items() if k != "lm_head.weight"})
