"""The CI conventions as docs/ci-gate.md gives them: the GitHub Actions gate step runs as
written (its summary a markdown verdict), and the pre-commit hooks name the gate."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from yafsdp_cli.cli import app

yaml = pytest.importorskip("yaml")
runner = CliRunner()
PAGE = (ROOT / "docs" / "ci-gate.md").read_text()


def workflow() -> dict:
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", PAGE, flags=re.S) if "jobs:" in b]
    assert len(blocks) == 1, "docs/ci-gate.md has one GitHub Actions workflow"
    return yaml.safe_load(blocks[0])


def baseline_command() -> list[str]:
    lines = re.findall(r"`(yafsdp check [^`]*ci/llama\.mem\.json[^`]*)`", PAGE)
    made = [line for line in lines if "--update" in line]
    assert made, "docs/ci-gate.md says how the workflow's baseline is written"
    return shlex.split(made[0])[2:]


def gate_step() -> tuple[list[str], str]:
    """The gate step's arguments and the file its stdout is appended to."""
    steps = workflow()["jobs"]["memory-gate"]["steps"]
    run = next(s["run"] for s in steps if "yafsdp check" in s.get("run", ""))
    command, _, target = run.partition(">>")
    assert target.strip() == '"$GITHUB_STEP_SUMMARY"'
    return shlex.split(command)[2:], "GITHUB_STEP_SUMMARY"


def test_the_workflow_gate_step_runs_as_written(tmp_path, monkeypatch):
    (tmp_path / "sample_models").symlink_to(ROOT / "sample_models")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    made = runner.invoke(app, ["check", *baseline_command()])
    assert made.exit_code == 0, made.output
    args, _ = gate_step()
    result = runner.invoke(app, ["check", *args])
    assert result.exit_code == 0, result.output
    summary = tmp_path / "summary.md"
    summary.write_text(result.stdout)  # what `>> "$GITHUB_STEP_SUMMARY"` appends
    text = summary.read_text()
    assert text.startswith("## yafsdp check: passed") and "### fake training step" in text
    assert "| activations saved for backward |" in text
    steps = workflow()["jobs"]["memory-gate"]["steps"]
    artifact = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert artifact["if"] == "always()"
    assert (tmp_path / artifact["with"]["path"]).is_file()


def test_pre_commit_hooks_run_the_gate():
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    by_id = {h["id"]: h for h in hooks}
    assert set(by_id) == {"yafsdp-check", "yafsdp-check-system"}
    for hook in hooks:
        assert hook["entry"] == "yafsdp check" and hook["pass_filenames"] is False
        assert hook["language"] in ("python", "system")
    config = next(b for b in re.findall(r"```yaml\n(.*?)```", PAGE, flags=re.S) if "hooks:" in b)
    used = yaml.safe_load(config)["repos"][0]["hooks"][0]
    assert used["id"] in by_id and used["args"][0] == "--baseline"
