"""Flat checkpoints: convert -> (reshard ->) restore is bit-exact, the file is plain
safetensors, and nothing partial is ever left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import assert_same_tensors, load_st, raw, read_header, sample
from conftest import ROOT
from helpers import build
from safetensors import safe_open
from safetensors.torch import load_model

from yafsdp_cli import plan
from yafsdp_cli.checkpoint import (
    INDEX_NAME,
    convert_checkpoint,
    open_flat,
    relayout,
    reshard_checkpoint,
    restore_checkpoint,
)
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.sources import load_source

SAFETENSORS = ("mlp", "cnn", "gpt", "llama", "moe")


def source_tensors(path) -> dict:
    if str(path).endswith(".safetensors"):
        return load_st(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", SAFETENSORS)
@pytest.mark.parametrize(("world_size", "align"), [(1, "yafsdp"), (4, "megatron"), (3, "fsdp")])
def test_safetensors_samples_round_trip(tmp_path, name, world_size, align):
    src = sample(f"{name}.safetensors")
    flat = tmp_path / "flat.safetensors"
    result = convert_checkpoint(src, flat, LayoutOptions(world_size=world_size, align=align))
    assert result.written and flat.is_file()
    assert result.bytes_read == sum(raw(t).__len__() for t in load_st(src).values())
    out = tmp_path / "restored.safetensors"
    restored = restore_checkpoint(flat, out)
    assert_same_tensors(load_st(src), load_st(out))
    # ties recorded as save_model does: the source's metadata, plus format
    with safe_open(str(src), "pt") as f:
        src_meta = f.metadata() or {}
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {**src_meta, "format": "pt"}
    assert restored.tied == {k: v for k, v in src_meta.items() if k != "format"}


@pytest.mark.parametrize("name", ["mlp.pt", "gpt.pt"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_state_dict_sources_round_trip(tmp_path, name, suffix):
    src = sample(name)
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(src, flat, LayoutOptions(world_size=2))
    out = tmp_path / f"restored{suffix}"
    restore_checkpoint(flat, out)
    original = torch.load(src, weights_only=True)
    if suffix == ".pt":
        got = torch.load(out, weights_only=True)
        assert_same_tensors(original, got)
        if name == "gpt.pt":  # tied names share one tensor again
            assert got["lm_head.weight"] is got["transformer.wte.weight"]
    else:
        got = load_st(out)
        assert_same_tensors({k: original[k] for k in got}, got)
        assert len(got) == len(original) - (name == "gpt.pt")  # the tie stored once


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "cnn"])
def test_model_factory_round_trip_loads_into_the_model(tmp_path, name):
    factory = f"sample_models.models:{name}"
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(
        sample(f"{name}.safetensors"),
        flat,
        LayoutOptions(filters=["linear"], world_size=4),
        model=factory,
    )
    out = tmp_path / "restored.safetensors"
    restore_checkpoint(flat, out)
    model, reference = build(name, seed=1), build(name, seed=2)  # weights to overwrite
    assert load_model(model, str(out)) == (set(), [])
    load_model(reference, str(sample(f"{name}.safetensors")))
    assert_same_tensors(reference.state_dict(), model.state_dict())


def test_factory_without_weights_uses_its_seeded_initialization(tmp_path):
    flat = tmp_path / "flat.safetensors"
    result = convert_checkpoint(
        None, flat, LayoutOptions(world_size=2), model="sample_models.models:mlp"
    )
    assert any("initialization" in n for n in result.notes)
    out = tmp_path / "restored.pt"
    restore_checkpoint(flat, out)
    expected = load_source(None, model="sample_models.models:mlp").build_module().state_dict()
    assert_same_tensors(expected, torch.load(out, weights_only=True))


@pytest.mark.parametrize(
    ("filters", "excludes", "units"),
    [
        ((), (), None),
        (("dtype:bf16",), (), None),
        (("name:*.mlp.*",), ("name:*.down_proj.*",), ("model.layers.*",)),
        (("all",), (), ("model.layers.1",)),
    ],
)
@pytest.mark.parametrize("align", ["yafsdp", "none", "128"])
def test_llama_mixed_dtypes_filters_units(tmp_path, filters, excludes, units, align):
    src = sample("llama.safetensors")
    flat = tmp_path / "flat.safetensors"
    result = convert_checkpoint(
        src,
        flat,
        LayoutOptions(filters=filters, excludes=excludes, units=units, world_size=3, align=align),
    )
    expected = plan(
        load_source(src).spec,
        LayoutOptions(filters=filters, excludes=excludes, units=units, world_size=3, align=align),
    )
    assert open_flat(flat).layout == expected
    assert {b.dtype for b in expected.buffers} >= ({"bfloat16"} if filters else {"float32"})
    assert result.checkpoint.kept == tuple(t.name for t in expected.kept)
    out = tmp_path / "restored.safetensors"
    restore_checkpoint(flat, out)
    assert_same_tensors(load_st(src), load_st(out))


@pytest.mark.parametrize(
    ("n", "sharded_in", "m", "sharded_out"),
    [
        (1, False, 4, True),  # one file -> sharded
        (4, True, 1, False),  # sharded -> one file
        (2, True, 3, True),
        (8, True, 2, True),
        (3, False, 5, False),
        (4, True, 4, True),
    ],
)
def test_reshard_round_trip(tmp_path, n, sharded_in, m, sharded_out):
    src = sample("moe.safetensors")
    first = tmp_path / ("in" if sharded_in else "in.safetensors")
    convert_checkpoint(src, first, LayoutOptions(world_size=n, align="fsdp"), sharded=sharded_in)
    second = tmp_path / ("out" if sharded_out else "out.safetensors")
    result = reshard_checkpoint(first, second, world_size=m, sharded=sharded_out)
    assert result.input_world_size == n and result.checkpoint.world_size == m
    restored = tmp_path / "restored.safetensors"
    restore_checkpoint(second, restored)
    assert_same_tensors(load_st(src), load_st(restored))
    # re-planning for M gives what planning for M directly gives: the same bytes
    direct = tmp_path / ("direct" if sharded_out else "direct.safetensors")
    convert_checkpoint(src, direct, LayoutOptions(world_size=m, align="fsdp"), sharded=sharded_out)
    assert _tree_bytes(second) == _tree_bytes(direct)


def _tree_bytes(path) -> dict:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {"": path.read_bytes()}


def test_relayout_equals_planning_for_the_new_world_size():
    spec = load_source(sample("gpt.safetensors")).spec
    for align in ("yafsdp", "fsdp", "megatron", "none", "64"):
        layout = plan(spec, LayoutOptions(world_size=4, align=align))
        for m in (1, 3, 16):
            assert relayout(layout, m) == plan(spec, LayoutOptions(world_size=m, align=align))


def test_flat_file_reads_with_plain_safetensors(tmp_path):
    """What docs/checkpoints.md promises: safe_open + json give every parameter back."""
    src = sample("gpt.safetensors")
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(src, flat, LayoutOptions(world_size=4, align="megatron"))
    original = load_st(src)
    with safe_open(str(flat), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt" and meta["yafsdp.format"] == "flat"
        layout = json.loads(meta["yafsdp.layout"])
        for buf in layout["buffers"]:
            data = f.get_tensor(buf["name"])  # 1-D, padding included
            assert data.shape == (buf["padded_numel"],)
            covered = torch.zeros(buf["padded_numel"], dtype=torch.bool)
            for e in buf["entries"]:
                view = data[e["offset"] : e["offset"] + e["numel"]].view(e["shape"])
                for n in (e["name"], *e["aliases"]):
                    if n in original:
                        assert torch.equal(view, original[n]), n
                covered[e["offset"] : e["offset"] + e["numel"]] = True
            assert not data[~covered].any()  # padding is zero
        for t in layout["kept"]:
            assert torch.equal(f.get_tensor(t["name"]), original[t["name"]])


def test_sharded_set_reads_with_plain_safetensors(tmp_path):
    src = sample("cnn.safetensors")
    out = tmp_path / "set"
    result = convert_checkpoint(src, out, LayoutOptions(world_size=4), sharded=True)
    index = json.loads((out / INDEX_NAME).read_text())
    names = [Path(f.path).name for f in result.checkpoint.files]
    assert [r["file"] for r in index["ranks"]] == names
    (buf,) = index["layout"]["buffers"]
    slices, kept = [], []
    for r in index["ranks"]:
        with safe_open(str(out / r["file"]), "pt") as f:
            slices.append(f.get_tensor(buf["name"]))
            assert slices[-1].shape == (buf["padded_numel"] // 4,)
            kept.append({t["name"]: f.get_tensor(t["name"]) for t in index["layout"]["kept"]})
    flat = torch.cat(slices)
    original = load_st(src)
    for e in buf["entries"]:
        view = flat[e["offset"] : e["offset"] + e["numel"]].view(e["shape"])
        assert torch.equal(view, original[e["name"]])
    assert kept[0] and all(k.keys() == kept[0].keys() for k in kept)  # every rank has them


def test_data_is_aligned_to_each_tensors_itemsize(tmp_path):
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(sample("llama.safetensors"), flat, LayoutOptions(world_size=3, align="none"))
    header, _ = read_header(flat)
    raw_len = int.from_bytes(flat.read_bytes()[:8], "little")
    assert raw_len % 8 == 0
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F64": 8, "U8": 1, "BOOL": 1}
    for name, info in header.items():
        if name != "__metadata__":
            assert info["data_offsets"][0] % sizes[info["dtype"]] == 0, name


def test_convert_of_safetensors_does_not_import_torch(tmp_path):
    flat, folder, restored = tmp_path / "f.safetensors", tmp_path / "s", tmp_path / "r.safetensors"
    code = (
        "import sys\n"
        "from yafsdp_cli.checkpoint import convert_checkpoint, reshard_checkpoint\n"
        "from yafsdp_cli.checkpoint import restore_checkpoint\n"
        "from yafsdp_cli.options import LayoutOptions\n"
        f"convert_checkpoint({str(sample('llama.safetensors'))!r}, {str(flat)!r},"
        " LayoutOptions(world_size=2), verify=True)\n"
        f"reshard_checkpoint({str(flat)!r}, {str(folder)!r}, world_size=4, sharded=True)\n"
        f"restore_checkpoint({str(folder)!r}, {str(restored)!r})\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr
    assert restored.is_file()


def test_verify_runs_the_model_check_with_an_architecture(tmp_path):
    from yafsdp_cli import verify

    model_check = verify.model_check  # as the command line hands it the convert's layout

    flat = tmp_path / "flat.safetensors"
    result = convert_checkpoint(
        sample("gpt.safetensors"),
        flat,
        LayoutOptions(filters=["linear"], world_size=2),
        model="sample_models.models:gpt",
        verify=True,
        model_check=model_check,
    )
    assert result.verify.ok and result.verify.model_ok is True, result.verify
    assert result.verify.model_check.startswith("passed")
    bare = convert_checkpoint(
        sample("gpt.safetensors"), tmp_path / "b.safetensors", verify=True, model_check=model_check
    )
    assert bare.verify.ok and bare.verify.model_ok is None
    assert "no architecture" in bare.verify.model_check


def test_failed_model_check_writes_nothing(tmp_path):
    out = tmp_path / "flat.safetensors"
    result = convert_checkpoint(
        sample("mlp.safetensors"), out, verify=True, model_check=lambda loaded, sel: (False, "3")
    )
    assert not result.written and result.verify.mismatches == ()
    assert list(tmp_path.iterdir()) == []
