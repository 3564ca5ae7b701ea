"""`yafsdp check`: the memory-regression gate."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.gate.check import compare

runner = CliRunner()


def write_model(path, layers: int, width: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up.weight"] = torch.randn(width, 64, generator=g)
        tensors[f"model.layers.{i}.mlp.down.weight"] = torch.randn(64, width, generator=g)
    tensors["model.embed.weight"] = torch.randn(100, 64, generator=g)
    save_file(tensors, str(path))


@pytest.fixture
def baseline(tmp_path):
    model = tmp_path / "model.safetensors"
    write_model(model, layers=2)
    base = tmp_path / "mem.json"
    result = runner.invoke(app, ["check", str(model), "-b", str(base), "--update", "-n", "4"])
    assert result.exit_code == 0, result.output
    return model, base


def test_update_writes_an_inspect_document_and_an_unchanged_model_passes(baseline):
    model, base = baseline
    doc = json.loads(base.read_text())
    assert doc["schema"] == "yafsdp.inspect/1" and doc["inputs"]["world_size"] == 4
    # Written through a temporary file: nothing else is left beside it.
    assert {p.name for p in base.parent.iterdir()} == {"model.safetensors", "mem.json"}
    result = runner.invoke(app, ["check", str(model), "-b", str(base)])
    assert result.exit_code == 0, result.output
    assert "ok: no figure grew" in result.output
    # The source is recorded: CI may name the baseline only.
    assert runner.invoke(app, ["check", "-b", str(base)]).exit_code == 0


def test_a_bigger_model_is_a_regression_naming_the_figures(baseline):
    model, base = baseline
    write_model(model, layers=3)
    result = runner.invoke(app, ["check", str(model), "-b", str(base), "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "yafsdp.check/1" and doc["passed"] is False
    regressed = {m["name"] for m in doc["metrics"] if m["regressed"]}
    assert {"parameters", "flat total per rank", "DDP baseline per rank"} <= regressed
    table = runner.invoke(app, ["check", str(model), "-b", str(base)])
    assert table.exit_code == 1 and "memory regression" in table.output


def test_tolerance_decides(baseline):
    model, base = baseline
    write_model(model, layers=2, width=66)  # about 2% more elements
    args = ["check", str(model), "-b", str(base)]
    assert runner.invoke(app, [*args, "--tolerance", "1"]).exit_code == 1
    assert runner.invoke(app, [*args, "--tolerance", "10"]).exit_code == 0


def test_options_override_the_recorded_inputs(baseline):
    model, base = baseline
    # Fewer ranks means more bytes per rank: a regression against the 4-rank baseline.
    result = runner.invoke(app, ["check", str(model), "-b", str(base), "-n", "2", "--json"])
    assert result.exit_code == 1
    assert json.loads(result.stdout)["inputs"]["world_size"] == 2
    assert runner.invoke(app, ["check", str(model), "-b", str(base), "-n", "8"]).exit_code == 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no baseline at"),
        ("{not json", "is not valid JSON"),
        ('{"schema": "yafsdp.profile/1"}', "expected 'yafsdp.inspect/1'"),
        ('{"schema": "yafsdp.inspect/1", "inputs": {}}', "lacks"),
    ],
)
def test_bad_baselines_exit_2(tmp_path, content, message):
    base = tmp_path / "mem.json"
    if content is not None:
        base.write_text(content)
    result = runner.invoke(app, ["check", "sample_models/mlp.safetensors", "-b", str(base)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_compare_handles_a_figure_that_was_zero():
    def doc(padding, params):
        schemes = [{"scheme": "yafsdp", "persistent": 10}]
        memory = {
            "flat_bytes": 10,
            "baseline_bytes": 10,
            "largest_unit_bytes": padding,
            "schemes": schemes,
        }
        return {"memory": memory, "params": {"total_numel": params}, "inputs": {}}

    report = compare(doc(0, 5), doc(4, 5), tolerance_percent=1, baseline_path="b", inputs={})
    grown = {m.name: m for m in report.metrics}["largest unit (gathered)"]
    assert grown.change_percent is None and grown.regressed and not report.passed
    same = compare(doc(0, 5), doc(0, 5), tolerance_percent=1, baseline_path="b", inputs={})
    assert same.passed
