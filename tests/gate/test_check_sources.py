"""`yafsdp check` on every kind of source: each passes against its own baseline, and the
baseline alone (no SOURCE, no --model) rebuilds the same inputs."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

runner = CliRunner()

FACTORY_FILE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 50)

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def build():
    return Net()
"""


def check(*args: str, code: int = 0):
    result = runner.invoke(app, ["check", *args])
    assert result.exit_code == code, result.output
    return result


def round_trip(base, *source: str, step: bool) -> dict:
    """--update, then the same command, then the baseline alone: all pass."""
    check(*source, "-b", str(base), "--update", "-n", "2")
    doc = json.loads(base.read_text())
    assert doc["schema"] == "yafsdp.baseline/2"
    assert (doc["step"] is not None) is step, doc["skipped"]
    for args in (source, ()):
        out = json.loads(check(*args, "-b", str(base), "--json").stdout)
        assert out["passed"] and out["inputs"]["world_size"] == 2
        groups = {m["group"] for m in out["metrics"]}
        assert groups == ({"memory", "step"} if step else {"memory"}), out["skipped"]
    return doc


@pytest.mark.parametrize("name", ["mlp.safetensors", "mlp.pt"])
def test_a_weights_file_passes_against_itself(tmp_path, samples_dir, name):
    src = tmp_path / name
    shutil.copy(samples_dir / name, src)
    doc = round_trip(tmp_path / "b.json", str(src), step=False)
    assert doc["source"] == {"path": str(src), "model": None, "kind": doc["source"]["kind"]}


def test_a_factory_module_passes_against_itself(tmp_path):
    doc = round_trip(tmp_path / "b.json", "--model", "sample_models.models:gpt", step=True)
    assert doc["source"]["path"] is None and doc["source"]["model"] == "sample_models.models:gpt"


def test_a_factory_with_weights_passes_against_itself(tmp_path):
    src = ("sample_models/gpt.safetensors", "--model", "sample_models.models:gpt")
    doc = round_trip(tmp_path / "b.json", *src, step=True)
    assert doc["source"]["path"] == "sample_models/gpt.safetensors"
    assert doc["step"]["inputs"]["world_size"] == 2


def test_a_factory_file_is_read_relative_to_where_check_runs(tmp_path, monkeypatch):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "netdefs.py").write_text(FACTORY_FILE)
    monkeypatch.chdir(tmp_path / "proj")
    # Given as an absolute path under the current directory: recorded relative to it.
    spec = f"{tmp_path / 'proj' / 'netdefs.py'}:build"
    doc = round_trip(tmp_path / "proj" / "mem.json", "--model", spec, step=True)
    assert doc["source"]["model"] == "netdefs.py:build"
    # A fresh clone elsewhere: the same relative spec, read from there.
    shutil.copytree(tmp_path / "proj", tmp_path / "clone")
    monkeypatch.chdir(tmp_path / "clone")
    check("-b", "mem.json")


def test_a_package_factory_is_imported_from_where_check_runs(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg_i20"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(FACTORY_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = round_trip(tmp_path / "mem.json", "--model", "mypkg_i20.nets:build", step=True)
    assert doc["source"]["model"] == "mypkg_i20.nets:build"


def test_a_hugging_face_folder_passes_against_itself(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from tests.hf_models import tiny_model

    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    doc = round_trip(tmp_path / "b.json", str(tmp_path / "llama"), step=True)
    assert doc["source"]["kind"] == "hf"
    patterns = {m["pattern"] for m in doc["step"]["modules"]}
    assert "model.layers.*.self_attn" in patterns
    # The same weights without their config cannot run the recorded step: exit 2.
    weights = str(tmp_path / "llama" / "model.safetensors")
    result = check(weights, "-b", str(tmp_path / "b.json"), code=2)
    assert "records a training step" in result.output and "--no-step" in result.output


def test_no_step_checks_the_memory_model_only(tmp_path):
    base = tmp_path / "b.json"
    check("--model", "sample_models.models:gpt", "-b", str(base), "--update")
    out = json.loads(check("-b", str(base), "--no-step", "--json").stdout)
    assert {m["group"] for m in out["metrics"]} == {"memory"}
    assert out["skipped"] == ["fake step: not run (--no-step)"]
