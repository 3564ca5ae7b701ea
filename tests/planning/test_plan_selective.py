"""``yafsdp plan --checkpointing`` with the selective modes: each cell's peak is the
converted step's that ``profile`` measures for that mode, rows and the JSON keep the
mode as given, and a bad mode is one error line."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
from helpers import plan_against_real_steps
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source

runner = CliRunner()
SCHEMA = json.loads(resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text())
MODES = ("none", "selective:op", "selective:layer=2", "non-reentrant")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tiny_model("llama").to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_plan_cells_equal_the_profiled_step_of_each_mode(llama, target):
    """CPU kernels: against the real converted step; CUDA's: ``profile --fake
    --target cuda``'s. World size 4 is the step at 2 resized."""
    peaks = plan_against_real_steps(
        load_source(llama), checkpointing=MODES, world_sizes=(1, 2, 4), target=target, seq_len=128
    )
    assert {ck for _, _, ck in peaks} == set(MODES)  # every mode planned and measured
    for ws, mb in ((1, 1), (4, 2)):
        at = {ck: peaks[(ws, mb, ck)] for ck in MODES}
        assert at["non-reentrant"] < at["selective:op"] < at["none"], at


def test_plan_json_keeps_the_modes_and_follows_its_schema(llama):
    result = runner.invoke(
        app,
        [
            "plan",
            str(llama),
            "--gpu-memory",
            "80GiB",
            "--world-size",
            "1,2",
            "--micro-batch",
            "1",
            "--seq-len",
            "64",
            "--checkpointing",
            ",".join(MODES),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["checkpointing"] == list(MODES)
    assert [r["checkpointing"] for r in doc["rows"] if r["world_size"] == 1] == list(MODES)
    assert any(n.startswith("selective:op: every unit") for n in doc["notes"])
    assert any(n.startswith("selective:layer=2: the 2nd, 4th, ...") for n in doc["notes"])


def test_the_schema_takes_each_mode_and_refuses_others():
    mode = {"$ref": "#/$defs/checkpointing", "$defs": SCHEMA["$defs"]}
    for good in ("none", "reentrant", "non-reentrant", "selective:op", "selective:layer=12"):
        jsonschema.validate(good, mode)
    for bad in ("selective:layer=0", "selective:layer=x", "selective:foo", "selective"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, mode)


@pytest.mark.parametrize(
    ("modes", "message"),
    [
        ("none,selective:layer=0", "--checkpointing 'selective:layer=0': N in selective:layer=N"),
        ("selective:layer=x", "--checkpointing 'selective:layer=x': N in selective:layer=N"),
        ("none,selective:foo", "--checkpointing 'selective:foo' is not one of"),
    ],
)
def test_plan_bad_modes_are_one_error_line(modes, message):
    argv = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "1GiB"]
    result = runner.invoke(app, [*argv, "--checkpointing", modes])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output
