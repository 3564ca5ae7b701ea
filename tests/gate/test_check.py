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
    # A few KiB more on a tiny model: past the percent, under the default byte floor.
    args = ["check", str(model), "-b", str(base), "--min-bytes", "0"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "yafsdp.check/2" and doc["passed"] is False
    regressed = {m["name"] for m in doc["metrics"] if m["regressed"]}
    assert {"parameters", "flat total per rank", "DDP baseline per rank"} <= regressed
    table = runner.invoke(app, args)
    assert table.exit_code == 1 and "memory regression" in table.output


def test_tolerance_decides(baseline):
    model, base = baseline
    write_model(model, layers=2, width=66)  # about 2% more elements, 2 KiB
    args = ["check", str(model), "-b", str(base), "--min-bytes", "0"]
    assert runner.invoke(app, [*args, "--tolerance", "1"]).exit_code == 1
    assert runner.invoke(app, [*args, "--tolerance", "10"]).exit_code == 0


def test_options_override_the_recorded_inputs(baseline):
    model, base = baseline
    # Fewer ranks means more bytes per rank: a regression against the 4-rank baseline.
    args = ["check", str(model), "-b", str(base), "--min-bytes", "0"]
    result = runner.invoke(app, [*args, "-n", "2", "--json"])
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
    assert runner.invoke(app, ["check", "-b", str(old), "--min-bytes", "0"]).exit_code == 1
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


def grown_model(tmp_path):
    """A baseline at two ranks, then the model three layers bigger: MiB more in each
    figure but the largest unit, more per rank unsharded (DDP) than sharded."""
    model, base = tmp_path / "big.safetensors", tmp_path / "big.json"
    write_model(model, layers=2, width=4096)
    result = runner.invoke(app, ["check", str(model), "-b", str(base), "--update", "-n", "2"])
    assert result.exit_code == 0, result.output
    write_model(model, layers=5, width=4096)
    return model, base


def test_the_verdict_comes_first_then_the_regressions_largest_first(tmp_path):
    model, base = grown_model(tmp_path)
    result = runner.invoke(app, ["check", str(model), "-b", str(base)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("memory regression: ")
    doc = json.loads(runner.invoke(app, ["check", str(model), "-b", str(base), "--json"]).stdout)
    grown = [m for m in doc["metrics"] if m["regressed"]]
    head = result.output.split("memory model, per rank")[0]
    assert f"{len(grown)} figures" in " ".join(head.split())
    listed = [s.strip().split(" +")[0] for s in head.splitlines() if s.startswith("  ")]
    by_bytes = sorted(
        (m for m in grown if m["unit"] == "bytes"), key=lambda m: m["baseline"] - m["current"]
    )
    assert listed == [m["name"] for m in by_bytes] + ["parameters"]
    assert listed[0] == "DDP baseline per rank"  # the largest growth, third in the table
    markdown = runner.invoke(app, ["check", str(model), "-b", str(base), "--markdown"]).stdout
    bullets = [s[4:].split(" +")[0] for s in markdown.splitlines() if s.startswith("- **")]
    assert bullets == listed
    # the markdown's first line is the verdict with its count, as the terminal's is
    first = markdown.splitlines()[0]
    assert first == f"## yafsdp check: FAILED: {len(grown)} figures grew past tolerance", first


def test_a_passing_markdown_says_so_first(baseline):
    _, base = baseline
    markdown = runner.invoke(app, ["check", "-b", str(base), "--markdown"])
    assert markdown.exit_code == 0, markdown.output
    first = markdown.stdout.splitlines()[0]
    assert first == "## yafsdp check: passed: no figure grew past its tolerance", first


def test_a_growth_under_the_byte_floor_passes(baseline):
    model, base = baseline
    write_model(model, layers=3)  # +50% of a tiny model: KiB
    args = ["check", str(model), "-b", str(base)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["passed"] and doc["min_bytes"] == 1024**2
    assert "byte floor 1.00 MiB" in runner.invoke(app, args).output
    assert runner.invoke(app, [*args, "--min-bytes", "4KiB"]).exit_code == 1
    assert (
        json.loads(runner.invoke(app, [*args, "--min-bytes", "0", "--json"]).stdout)["min_bytes"]
        == 0
    )


def test_a_big_growth_fails_past_the_default_byte_floor(tmp_path):
    model, base = grown_model(tmp_path)
    assert runner.invoke(app, ["check", str(model), "-b", str(base)]).exit_code == 1
    assert runner.invoke(app, ["check", "-b", str(base), "--min-bytes", "1GiB"]).exit_code == 0


@pytest.mark.parametrize("size", ["12", "-1MiB", "lots"])
def test_a_bad_min_bytes_exits_2(baseline, size):
    _, base = baseline
    result = runner.invoke(app, ["check", "-b", str(base), "--min-bytes", size])
    assert result.exit_code == 2 and "--min-bytes" in result.output, result.output
