"""The gate's fake training step catches the regressions training code makes with the
parameters unchanged: an attention switch (eager instead of sdpa) and dropped
activation checkpointing. A tiny transformers Llama, defined in a factory file the
test writes, as a project's CI would define it."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

pytest.importorskip("transformers")

runner = CliRunner()

MODELS = """
import transformers as tf


def _config(attn):
    config = tf.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    config._attn_implementation = attn
    return config


def sdpa():
    return tf.LlamaForCausalLM(_config("sdpa"))


def eager():
    return tf.LlamaForCausalLM(_config("eager"))
"""
SAVED = "activations saved for backward"
STEP = ("-n", "2", "--batch", "2", "--seq-len", "128")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("ci") / "models.py"
    path.write_text(MODELS)
    return path


def check(*args: str):
    return runner.invoke(app, ["check", *args])


def update(base, *args: str) -> None:
    result = check("-b", str(base), "--update", *args)
    assert result.exit_code == 0, result.output


def test_the_same_model_passes_and_the_attention_switch_fails(models, tmp_path):
    base = tmp_path / "mem.json"
    update(base, "--model", f"{models}:sdpa", *STEP)
    same = check("-b", str(base), "--json")
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["step_inputs"]["seq_len"] == 128
    switched = check("-b", str(base), "--model", f"{models}:eager")
    assert switched.exit_code == 1, switched.output
    text = " ".join(switched.output.split())
    assert "activations saved for backward +" in text and ": model.layers.*.self_attn" in text
    # The parameters did not change: no memory-model figure regressed.
    doc = json.loads(check("-b", str(base), "--model", f"{models}:eager", "--json").stdout)
    grown = {m["name"] for m in doc["metrics"] if m["regressed"]}
    assert grown and all(m["group"] == "step" for m in doc["metrics"] if m["regressed"])
    activations = next(m for m in doc["metrics"] if m["name"] == SAVED)
    assert activations["current"] > activations["baseline"]
    assert activations["explained_by"] == ["model.layers.*.self_attn"]


def test_dropped_checkpointing_fails_naming_activations(models, tmp_path):
    base = tmp_path / "mem.json"
    update(base, "--model", f"{models}:sdpa", *STEP, "--checkpointing", "non-reentrant")
    assert json.loads(base.read_text())["step"]["inputs"]["checkpointing"] == "non-reentrant"
    kept = check("-b", str(base))
    assert kept.exit_code == 0, kept.output
    dropped = check("-b", str(base), "--checkpointing", "none", "--markdown")
    assert dropped.exit_code == 1, dropped.output
    assert dropped.output.startswith("## yafsdp check: FAILED")
    line = next(s for s in dropped.output.splitlines() if SAVED in s)
    assert line.startswith(f"- **{SAVED} +") and "model.layers.* (" in line
    # A generous step tolerance lets the same growth pass.
    loose = check("-b", str(base), "--checkpointing", "none", "--step-tolerance", "100000")
    assert loose.exit_code == 0, loose.output


def test_the_fake_step_gives_the_same_figures_every_time(models):
    from yafsdp_cli.gate.baseline import StepInputs
    from yafsdp_cli.gate.step_figures import measure_step
    from yafsdp_cli.options import LayoutOptions
    from yafsdp_cli.sources import load_source

    inputs = StepInputs(2, 64, "none", 2, "adamw")
    runs = [
        dataclasses.asdict(
            measure_step(load_source(None, model=f"{models}:eager"), inputs, LayoutOptions())
        )
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0]["peak_total"] == sum(runs[0]["peak"].values()) > 0


def test_bad_step_options_exit_2(models, tmp_path):
    base = tmp_path / "mem.json"
    result = check("-b", str(base), "--update", "--model", f"{models}:sdpa", "--checkpointing", "x")
    assert result.exit_code == 2 and "--checkpointing 'x'" in result.output
    assert not base.exists()


def test_torch_module_tracking_warning_does_not_reach_the_user(models, tmp_path):
    """ModTracker warns about its own hierarchy on every transformers step; that is not
    about the user's model, so it is silenced, and other warnings are not."""
    import warnings

    base = tmp_path / "mem.json"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        update(base, "--model", f"{models}:sdpa", *STEP)
        result = check("-b", str(base))
        warnings.warn("the user's own", UserWarning, stacklevel=1)
    assert result.exit_code == 0, result.output
    messages = [str(w.message) for w in seen]
    assert not any("module hierarchy" in m for m in messages), messages
    assert "the user's own" in messages
    assert "module hierarchy" not in result.output
    # The tracker's process-wide formatwarning is put back.
    assert warnings.formatwarning.__module__ == "warnings"


@pytest.mark.parametrize(
    "args",
    [
        ["check", "-b", "{tmp}/mem.json", "--update", "--model", "{models}:sdpa", *STEP],
        ["profile", "--model", "{models}:sdpa", "--seq-len", "128"],
        ["profile", "--model", "{models}:sdpa", "--fake", "--seq-len", "128"],
        [
            "plan",
            "--model",
            "{models}:sdpa",
            "--gpu-memory",
            "1GiB",
            "--seq-len",
            "128",
            "--world-size",
            "1,2",
            "--micro-batch",
            "1",
            "--checkpointing",
            "none,reentrant",
            "--jobs",
            "1",
        ],  # fmt: skip
    ],
    ids=["check", "profile", "profile-fake", "plan"],
)
def test_no_third_party_warning_reaches_the_terminal(models, tmp_path, args):
    """What a user's terminal shows of a transformers model's step, the process's own
    warning filters in force: no warning at all (torch's module tracker warns on every
    such step; it is silenced by message and category where the step runs)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import ROOT

    argv = [a.format(tmp=tmp_path, models=models) for a in args]
    exe = Path(sys.executable).with_name("yafsdp")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run([str(exe), *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # a warning prints as "file:line: SomeWarning: message"
    assert not re.search(r"\w+Warning: ", done.stderr), done.stderr
