"""``plan --grad-accum N``: every cell's fake step runs N micro-batches, and its peak
is the real step's of N micro-batches, to the byte; the documents carry it."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.planning import PlanOptions, plan_model
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.profiling.profiler import profile_converted
from yafsdp_cli.sources import load_source

runner = CliRunner()
SCHEMA = json.loads(resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text())


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_each_cell_of_n_micro_batches_equals_the_real_step(name):
    """World size 1 is its own step, 2 and 4 one step resized: each cell against a
    real step of 5 micro-batches at its world size, micro-batch and checkpointing."""
    opts = options(
        PlanOptions, gpu_memory=2**40, reserve=0, world_sizes=(1, 2, 4), micro_batches=(1, 2),
        seq_len=16, target="cpu", grad_accum=5, checkpointing=("none", "non-reentrant"),
    )  # fmt: skip
    report = plan_model(loaded(name), opts)
    assert report.grad_accum == 5 and len(report.rows) == 12
    for row in report.rows:
        real = profile_converted(
            loaded(name),
            options(
                ProfileOptions,
                world_size=row.world_size,
                batch=row.micro_batch,
                seq_len=16,
                checkpointing=row.checkpointing,
                grad_accum=5,
                param_dtype="bf16",
                optimizer_impl="foreach",
            ),  # fmt: skip
        )
        cell = (row.world_size, row.micro_batch, row.checkpointing)
        assert row.peak_bytes == real.peak.total, cell
        assert (row.peak_phase, row.peak_micro_batch) == (real.peak_phase, real.peak_micro_batch)


def test_accumulation_holds_more_and_the_documents_say_so():
    args = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "1TiB", "--reserve"]
    args += ["0", "--target", "cpu", "--world-size", "1,2", "--micro-batch", "1", "--seq-len"]
    args += ["16", "--json"]
    one, four = (runner.invoke(app, [*args, "--grad-accum", n]) for n in ("1", "4"))
    assert one.exit_code == four.exit_code == 0, four.output
    a, b = json.loads(one.stdout), json.loads(four.stdout)
    for doc in (a, b):
        jsonschema.validate(doc, SCHEMA)
    assert (a["grad_accum"], b["grad_accum"]) == (1, 4)
    assert b["options"]["grad_accum"] == 4
    assert "micro-batches per optimizer step (--grad-accum)" in b["answer"][-1]
    assert "--grad-accum" not in a["answer"][-1]
    for ra, rb in zip(a["rows"], b["rows"]):
        # the later micro-batches' forwards hold the earlier ones' gradients
        assert rb["peak_bytes"] >= ra["peak_bytes"]
    assert any(r["peak_micro_batch"] > 1 for r in b["rows"])
    assert all(r["peak_micro_batch"] == 1 for r in a["rows"])
    md = runner.invoke(app, [*args[:-1], "--grad-accum", "4", "--format", "markdown"])
    assert md.exit_code == 0 and "4 micro-batches accumulated per optimizer step" in md.stdout


@pytest.mark.parametrize("bad", ["0", "-2", "1025", "x", "1e400"])
def test_a_bad_grad_accum_is_one_line_and_exit_2(bad):
    for command in (["plan", "--gpu-memory", "80GiB"], ["profile", "--fake"], ["check", "-b", "x"]):
        result = runner.invoke(
            app, [*command, "--model", "sample_models.models:gpt", "--grad-accum", bad]
        )
        assert result.exit_code == 2, result.output
        assert "--grad-accum" in result.output and "Traceback" not in result.output
