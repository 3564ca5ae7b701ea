"""DCP -> flat -> DCP: convert from a DCP folder, restore --format dcp, bit for bit;
the other commands on a DCP source; the DCP output's safety."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
from checkpoint_helpers import assert_same_tensors, load_st, raw, sample
from dcp_samples import load_dcp_tensors, save_dcp, training_checkpoint
from helpers import build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from yafsdp_cli import CheckpointError
from yafsdp_cli.checkpoint import convert_checkpoint, dcp_write, restore_checkpoint
from yafsdp_cli.cli import app
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.sources import load_source

runner = CliRunner()
SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/checkpoint.schema.json").read_text()
)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def gpt_dcp(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "step-1"
    return path, training_checkpoint(path, "gpt")


def test_dcp_to_flat_to_dcp_is_byte_identical(gpt_dcp, tmp_path):
    src, weights = gpt_dcp
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back"
    result = run("convert", src, "-o", flat, "--world-size", "4", "--verify")
    assert result.exit_code == 0, result.output
    assert "read back bit for bit" in " ".join(result.stdout.split())
    # --weights-only: the weights under their own names (the whole training
    # checkpoint, in its nesting, is tests/checkpoint/test_checkpoint_train.py's)
    result = run("restore", flat, "-o", back, "--format", "dcp", "--json", "--weights-only")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["format"] == "dcp" and doc["tensors"] == len(weights)
    files = sorted(p.name for p in back.iterdir())  # one data file per tensor
    assert files == [".metadata", *sorted(f"__0_{i}.distcp" for i in range(len(weights)))]
    # torch's own loader fills a plain model's state dict, tied lm_head included
    assert_same_tensors(load_dcp_tensors(back, weights), weights)
    model = build("gpt", seed=5)  # other weights
    model.load_state_dict(load_dcp_tensors(back, model.state_dict()))
    assert_same_tensors(model.state_dict(), weights)
    # and yafsdp reads it back as the same weights, byte for byte
    a, b = load_source(src), load_source(back)
    assert sorted(a.reader.names()) == sorted(b.reader.names())
    for name in a.reader.names():
        assert raw(a.reader.load(name)) == raw(b.reader.load(name)), name


def test_sharded_flat_set_to_dcp_and_back_to_safetensors(tmp_path):
    """Entries that straddle rank files are reassembled; bf16/fp32 mixed."""
    src = sample("llama.safetensors")
    flat, dcp_dir, again = tmp_path / "set", tmp_path / "dcp", tmp_path / "again.safetensors"
    convert_checkpoint(src, flat, LayoutOptions(world_size=3, align="none"), sharded=True)
    result = restore_checkpoint(flat, dcp_dir, fmt="dcp")
    assert result.format == "dcp" and result.input_sharded
    original = load_st(src)
    assert_same_tensors(load_dcp_tensors(dcp_dir, original), original)
    convert_checkpoint(dcp_dir, tmp_path / "f2.safetensors", LayoutOptions(world_size=2))
    restore_checkpoint(tmp_path / "f2.safetensors", again)
    assert_same_tensors(load_st(again), original)


def test_other_commands_take_a_dcp_source(gpt_dcp, tmp_path):
    src, _ = gpt_dcp
    model = "sample_models.models:gpt"
    result = run("verify", src, "--model", model, "--steps", "1")
    assert result.exit_code == 0, result.output
    result = run("profile", src, "--model", model, "--fake", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["converted"]["peak_bytes"] > 0
    base = tmp_path / "base.json"
    result = run("check", src, "--baseline", base, "--update", "-n", "4")
    assert result.exit_code == 0, result.output
    assert json.loads(base.read_text())["inputs"]["optimizer"] == "adamw"
    result = run("check", src, "--baseline", base)
    assert result.exit_code == 0, result.output
    result = run("check", src, "--baseline", base, "-n", "1")  # unsharded: a regression
    assert result.exit_code == 1, result.output


def test_dcp_output_is_safe(gpt_dcp, tmp_path):
    src, _ = gpt_dcp
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(src, flat)
    out = tmp_path / "out"
    restore_checkpoint(flat, out, fmt="dcp")
    before = (out / "__0_0.distcp").read_bytes()
    with pytest.raises(CheckpointError, match="exists; pass --force"):
        restore_checkpoint(flat, out, fmt="dcp")
    restore_checkpoint(flat, out, fmt="dcp", force=True)  # a DCP folder is replaced
    assert (out / "__0_0.distcp").read_bytes() == before
    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    result = run("restore", flat, "-o", stranger, "--format", "dcp", "--force")
    assert result.exit_code == 2 and "never replaced" in result.stderr, result.output
    assert (stranger / "notes.txt").read_text() == "keep me"
    for bad, match in (
        (tmp_path / "x.safetensors", "writes a folder"),
        (flat, "writes a folder"),
    ):
        with pytest.raises(CheckpointError, match=match):
            restore_checkpoint(flat, bad, fmt="dcp")
    with pytest.raises(CheckpointError, match=r"is the input .* \(or holds it\)"):
        restore_checkpoint(flat, tmp_path, fmt="dcp", force=True)
    with pytest.raises(CheckpointError, match="is a safetensors file name, but --format is pt"):
        restore_checkpoint(flat, tmp_path / "o.safetensors", fmt="pt")
    result = run("restore", flat, "-o", tmp_path / "o", "--format", "zip")
    assert result.exit_code == 2 and "is not one of safetensors | pt | dcp" in result.stderr


def test_a_failed_write_leaves_nothing(gpt_dcp, tmp_path, monkeypatch):
    src, _ = gpt_dcp
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(src, flat)
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise CheckpointError("disk on fire")
        return real(*args)

    real = dcp_write._tensor_data
    monkeypatch.setattr(dcp_write, "_tensor_data", failing)
    result = run("restore", flat, "-o", tmp_path / "out", "--format", "dcp")
    assert result.exit_code == 2 and "disk on fire" in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat.safetensors"]


DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=5, max_size=5),
    world=st.integers(1, 5),
    sharded=st.booleans(),
)
def test_round_trip_property(tmp_path_factory, shapes, dtypes, world, sharded):
    tmp = tmp_path_factory.mktemp("prop")
    gen = torch.Generator().manual_seed(len(shapes) * 31 + world)
    state = {
        f"layers.{i}.w": (torch.randn(s, generator=gen) * 100).to(dt)
        for i, (s, dt) in enumerate(zip(shapes, dtypes))
    }
    save_dcp(tmp / "src", state)
    flat = tmp / ("set" if sharded else "flat.safetensors")
    convert_checkpoint(tmp / "src", flat, LayoutOptions(world_size=world), sharded=sharded)
    restore_checkpoint(flat, tmp / "back", fmt="dcp")
    assert_same_tensors(load_dcp_tensors(tmp / "back", state), state)
