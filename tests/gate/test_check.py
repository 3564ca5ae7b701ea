"""`yafsdp check`: the memory-regression gate."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.gate.baseline import MemoryFigures
from yafsdp_cli.gate.regressions import compare_memory

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


def test_update_writes_a_baseline_and_an_unchanged_model_passes(baseline):
    model, base = baseline
    doc = json.loads(base.read_text())
    assert doc["schema"] == "yafsdp.baseline/2" and doc["inputs"]["world_size"] == 4
    # No architecture: no step, and the baseline says why.
    assert doc["step"] is None and "no architecture" in doc["skipped"][0]
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
    assert doc["schema"] == "yafsdp.check/2" and doc["passed"] is False
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
        ("{not json", "mem.json: not valid JSON"),
        ('{"schema": "yafsdp.profile/1"}', "expected 'yafsdp.baseline/2'"),
        ('{"schema": "yafsdp.inspect/1", "inputs": {}}', "lacks"),
        ('{"schema": "yafsdp.baseline/2", "source": {}}', "lacks"),
        ("[1, 2]", "has schema 'list'"),
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
    def figures(unit, params):
        return MemoryFigures(10, 10, 10, unit, params)

    metrics = compare_memory(figures(0, 5), figures(4, 5), 1)
    grown = {m.name: m for m in metrics}["largest unit (gathered)"]
    assert grown.change_percent is None and grown.regressed
    assert not any(m.regressed for m in compare_memory(figures(0, 5), figures(0, 5), 1))


def test_an_inspect_document_is_still_a_baseline_and_says_what_it_skipped(tmp_path):
    model = tmp_path / "model.safetensors"
    write_model(model, layers=2)
    old = tmp_path / "old.json"
    inspect = runner.invoke(app, ["inspect", str(model), "-n", "4", "--json"])
    assert inspect.exit_code == 0, inspect.output
    old.write_text(inspect.stdout)
    result = runner.invoke(app, ["check", "-b", str(old), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] and len(doc["metrics"]) == 5 and doc["inputs"]["world_size"] == 4
    assert any("no step figures" in s for s in doc["skipped"])
    write_model(model, layers=3)
    assert runner.invoke(app, ["check", "-b", str(old)]).exit_code == 1
    # --update rewrites it as a versioned baseline.
    assert runner.invoke(app, ["check", "-b", str(old), "--update"]).exit_code == 0
    assert json.loads(old.read_text())["schema"] == "yafsdp.baseline/2"


def test_update_replaces_an_unreadable_baseline(tmp_path):
    model, base = tmp_path / "m.safetensors", tmp_path / "b.json"
    write_model(model, layers=2)
    base.write_text("{not json")
    result = runner.invoke(app, ["check", str(model), "-b", str(base), "--update"])
    assert result.exit_code == 0, result.output
    assert runner.invoke(app, ["check", "-b", str(base)]).exit_code == 0
