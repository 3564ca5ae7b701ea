"""``yafsdp check`` carries a selective checkpointing mode in its step: the baseline
records it, the same step passes, and training without it fails on the activations."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

pytest.importorskip("transformers")

runner = CliRunner()
MODELS = """
import transformers as tf


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ))
"""
SAVED = "activations saved for backward"


def check(*args: str):
    return runner.invoke(app, ["check", *args])


def _baseline(tmp_path, mode: str):
    models = tmp_path / "models.py"
    models.write_text(MODELS)
    base = tmp_path / "mem.json"
    step = ("--model", f"{models}:llama", "-n", "2", "--batch", "2", "--seq-len", "128")
    made = check("-b", str(base), "--update", *step, "--checkpointing", mode)
    assert made.exit_code == 0, made.output
    assert json.loads(base.read_text())["step"]["inputs"]["checkpointing"] == mode
    return base


@pytest.mark.parametrize("mode", ["selective:op", "selective:layer=2"])
def test_check_records_a_selective_mode_and_the_same_step_passes(tmp_path, mode):
    base = _baseline(tmp_path, mode)
    same = check("-b", str(base), "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["step_inputs"]["checkpointing"] == mode
    full = check("-b", str(base), "--checkpointing", "non-reentrant", "--json")
    assert full.exit_code == 0, full.output  # fewer bytes than the baseline's


def test_dropping_selective_op_fails_on_the_activations(tmp_path):
    base = _baseline(tmp_path, "selective:op")
    # a tiny model: its growth is under the default 1 MiB floor, so the floor is lowered
    dropped = check("-b", str(base), "--checkpointing", "none", "--min-bytes", "1KiB", "--json")
    assert dropped.exit_code == 1, dropped.output
    metrics = json.loads(dropped.stdout)["metrics"]
    saved = next(m for m in metrics if m["name"] == SAVED)
    assert saved["current"] > saved["baseline"]
    assert any(m["regressed"] for m in metrics)
    assert all(m["group"] == "step" for m in metrics if m["regressed"])


def test_check_refuses_a_bad_mode_before_anything_runs(tmp_path):
    base = tmp_path / "mem.json"
    result = check(
        "-b", str(base), "--update", "--model", "x:y", "--checkpointing", "selective:foo"
    )
    assert result.exit_code == 2, result.output
    assert "--checkpointing 'selective:foo' is not one of" in " ".join(result.output.split())
    assert not base.exists()
