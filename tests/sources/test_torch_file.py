"""Torch files (state dicts, training checkpoints, pickled modules, index sets) and
``--model`` factories behind ``load_source``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import SAMPLES
from tests.helpers import build
from yafsdp_cli import SourceError
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source

runner = CliRunner()


def inspect_exit(path, *args) -> tuple[int, str]:
    result = runner.invoke(app, ["inspect", str(path), *args])
    return result.exit_code, result.stderr


# ---------------------------------------------------------------- torch files


def test_pt_state_dict_loads_with_mmap_and_bytes_match():
    loaded = load_source(SAMPLES / "mlp.pt")
    model = build("mlp")
    model.load_state_dict(torch.load(SAMPLES / "mlp.pt", weights_only=True))
    assert loaded.spec.source_kind == "state dict"
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.reader.load(name), t)


def test_pt_shared_storage_is_one_tied_record():
    spec = load_source(SAMPLES / "gpt.pt").spec
    tied = [t for t in spec.tensors if t.aliases]
    assert [(t.name, t.aliases) for t in tied] == [("transformer.wte.weight", ("lm_head.weight",))]


def test_nested_training_checkpoint(tmp_path):
    sd = build("mlp").state_dict()
    torch.save({"model": sd, "optimizer": {"lr": 0.1}, "epoch": 3}, tmp_path / "ckpt.pt")
    loaded = load_source(tmp_path / "ckpt.pt")
    assert [t.name for t in loaded.spec.tensors] == list(sd)
    assert any("checkpoint's 'model' entry" in n for n in loaded.spec.notes)


TORCH_CASES = {
    "no state dict": (lambda p: torch.save({"epoch": 3}, p), "no state dict found; top-level"),
    "a tensor": (lambda p: torch.save(torch.ones(2), p), "holds a Tensor, not a state dict"),
    "garbage": (
        lambda p: p.write_bytes(b"\x80\x02garbage" * 10),
        "cannot load safely|not a readable",
    ),
    "truncated zip": (
        lambda p: (torch.save({"a": torch.ones(100)}, p), os.truncate(p, 200)),
        "not a readable torch file",
    ),
}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_bad_torch_files_are_refused(tmp_path, case):
    path = tmp_path / "x.pt"
    make, message = TORCH_CASES[case]
    make(path)
    with pytest.raises(SourceError, match=message):
        load_source(path)
    code, err = inspect_exit(path)
    assert code == 2 and err.count("\n") == 1, err


def test_legacy_torch_format_loads(tmp_path):
    sd = {"w": torch.randn(3, 3)}
    torch.save(sd, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    loaded = load_source(tmp_path / "old.bin")
    assert torch.equal(loaded.reader.load("w"), sd["w"])


def test_pickled_module_is_refused_naming_the_class_and_flag():
    path = SAMPLES / "gpt_module.pt"
    with pytest.raises(
        SourceError, match="holds a pickled sample_models.models.GPT; .*--trust-pickle"
    ):
        load_source(path)
    code, err = inspect_exit(path)
    assert code == 2 and "--trust-pickle" in err
    loaded = load_source(path, trust_pickle=True)
    assert loaded.spec.has_architecture and loaded.module is not None
    assert any(t.aliases for t in loaded.spec.tensors)  # lm_head tied to wte, from the module


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"x": _Evil(str(marker))}, path)
    with pytest.raises(SourceError, match="holds a pickled (posix|os).system"):
        load_source(path)
    assert not marker.exists()


def test_bin_index_set(tmp_path):
    a, b = {"layers.0.w": torch.randn(2, 2)}, {"layers.1.w": torch.randn(2, 2)}
    torch.save(a, tmp_path / "pytorch_model-1.bin")
    torch.save(b, tmp_path / "pytorch_model-2.bin")
    weight_map = {"layers.0.w": "pytorch_model-1.bin", "layers.1.w": "pytorch_model-2.bin"}
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_source(tmp_path)  # the folder finds the index
    assert torch.equal(loaded.reader.load("layers.1.w"), b["layers.1.w"])
    weight_map["layers.1.w"] = "pytorch_model-1.bin"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(SourceError, match="names \\['layers.1.w'\\], which no shard it names hol"):
        load_source(index)
    weight_map["layers.1.w"], weight_map["layers.0.w"] = (
        "pytorch_model-2.bin",
        "pytorch_model-2.bin",
    )
    weight_map["extra"] = "pytorch_model-1.bin"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(SourceError, match="-1.bin holds 'layers.0.w', but the weight_map puts it"):
        load_source(index)


# ---------------------------------------------------------------- --model factories


def test_factory_without_weights_is_an_architecture_on_meta():
    loaded = load_source(None, model="sample_models.models:llama")
    assert loaded.reader is None and loaded.spec.has_architecture
    assert next(loaded.module.parameters()).device.type == "meta"
    norm = loaded.spec.by_name()["model.norm.weight"]
    assert norm.kinds == ("norm",) and norm.dtype == "float32"
    with pytest.raises(SourceError, match="has no weights"):
        loaded.stored_name(norm)


def test_factory_with_weights_builds_the_real_model():
    loaded = load_source(SAMPLES / "llama.safetensors", model="sample_models.models:llama")
    assert loaded.spec.has_architecture and loaded.reader is not None
    model = loaded.build_module()
    stored = load_source(SAMPLES / "llama.safetensors").reader
    for name, t in model.state_dict().items():
        if name in stored.names():
            assert torch.equal(t, stored.load(name)), name


def test_factory_from_a_file(tmp_path):
    (tmp_path / "arch.py").write_text(
        "from torch import nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))\n"
    )
    loaded = load_source(None, model=f"{tmp_path / 'arch.py'}:build")
    assert [t.kinds for t in loaded.spec.params] == [("linear",)] * 2 + [("norm",)] * 2


def test_weights_that_do_not_fit_the_factory():
    with pytest.raises(
        SourceError, match="the weights do not fit --model sample_models.models:gpt"
    ):
        load_source(SAMPLES / "mlp.safetensors", model="sample_models.models:gpt")


FACTORY_CASES = {
    "nocolon": "expected package.module:factory or file.py:factory",
    "no_such_pkg_xyz:f": "cannot import 'no_such_pkg_xyz'",
    "sample_models.models:nothing": "has no attribute 'nothing'",
    "sample_models.models:FACTORIES": "'FACTORIES' is not callable",
    "sample_models.models:math.sqrt": "the factory failed|returned",
    "missing/file.py:build": "no such file 'missing/file.py'",
}


@pytest.mark.parametrize("text", sorted(FACTORY_CASES))
def test_bad_factories(text):
    with pytest.raises(SourceError, match=FACTORY_CASES[text]):
        load_source(None, model=text)
    result = runner.invoke(app, ["inspect", "--model", text])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output


def test_a_factory_returning_no_module(tmp_path):
    (tmp_path / "bad.py").write_text("def build():\n    return 42\n")
    with pytest.raises(SourceError, match="returned a int, not an nn.Module"):
        load_source(None, model=f"{tmp_path / 'bad.py'}:build")


def test_state_dict_without_architecture_cannot_build_a_module():
    with pytest.raises(SourceError, match="running the model needs its architecture; give --model"):
        load_source(SAMPLES / "mlp.pt").build_module()


def _yafsdp(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    exe = Path(sys.executable).with_name("yafsdp")
    return subprocess.run([str(exe), *argv], cwd=cwd, env=env, capture_output=True, text=True)


def test_a_pickled_module_loads_from_the_folder_the_user_runs_in(tmp_path):
    """As --model does: the current directory is on the import path for its classes."""
    pickled = str(SAMPLES / "gpt_module.pt")
    here = _yafsdp("inspect", pickled, "--trust-pickle", "--json", cwd=SAMPLES.parent)
    assert here.returncode == 0, here.stderr
    elsewhere = _yafsdp("inspect", pickled, "--trust-pickle", cwd=tmp_path)
    assert elsewhere.returncode == 2
    assert "needs module 'sample_models'" in elsewhere.stderr
    assert str(tmp_path) in elsewhere.stderr and "Traceback" not in elsewhere.stderr
