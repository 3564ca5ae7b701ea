"""``check --grad-accum N``: a baseline records the micro-batches of its fake step, a
check runs them again, and a change of them is a change of the step's inputs that
the report states and the figures follow (more micro-batches: the later forwards
hold the earlier gradients)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

runner = CliRunner()
MODEL = ("--model", "sample_models.models:gpt", "--min-bytes", "0")


def check(*args: str):
    return runner.invoke(app, ["check", *MODEL, *args])


@pytest.fixture
def baseline(tmp_path):
    base = tmp_path / "mem.json"
    made = check("-b", str(base), "--update", "--grad-accum", "4")
    assert made.exit_code == 0, made.output
    assert "4 micro-batches per optimizer step" in made.output
    return base


def test_the_baseline_records_the_micro_batches_and_a_check_runs_them(baseline):
    doc = json.loads(baseline.read_text())
    assert doc["step"]["inputs"]["grad_accum"] == 4
    same = check("-b", str(baseline), "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["step_inputs"]["grad_accum"] == 4
    table = check("-b", str(baseline))
    assert "4 micro-batches per optimizer step" in " ".join(table.output.split())


def test_more_micro_batches_than_the_baseline_is_a_regression(tmp_path):
    base = tmp_path / "one.json"
    assert check("-b", str(base), "--update").exit_code == 0
    assert json.loads(base.read_text())["step"]["inputs"]["grad_accum"] == 1
    more = check("-b", str(base), "--grad-accum", "2", "--json")
    assert more.exit_code == 1, more.output
    doc = json.loads(more.stdout)
    assert doc["step_inputs"]["grad_accum"] == 2
    grown = {m["name"] for m in doc["metrics"] if m["regressed"]}
    assert "forward peak" in grown  # the second forward holds the first's gradients
    fewer = check("-b", str(base), "--grad-accum", "1")
    assert fewer.exit_code == 0, fewer.output


def test_a_baseline_without_it_is_one_micro_batch_and_a_bad_one_is_refused(baseline):
    doc = json.loads(baseline.read_text())
    del doc["step"]["inputs"]["grad_accum"]
    baseline.write_text(json.dumps(doc))
    older = check("-b", str(baseline), "--json")
    assert json.loads(older.stdout)["step_inputs"]["grad_accum"] == 1
    for bad in (0, 1e400, 4096):
        doc["step"]["inputs"]["grad_accum"] = bad
        baseline.write_text(json.dumps(doc).replace("Infinity", "1e400"))
        refused = check("-b", str(baseline))
        assert refused.exit_code == 2, refused.output
        assert "step.inputs.grad_accum" in refused.output
