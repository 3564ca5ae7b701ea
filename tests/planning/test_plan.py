"""``yafsdp plan``: its peaks against real measured steps, its grid, its errors."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
import torch
from helpers import options, plan_against_real_steps
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine.plan import plan
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.planning import PlanOptions, parse_ints, parse_size, plan_model
from yafsdp_cli.sources import load_source

runner = CliRunner()
SCHEMA = json.loads(resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text())
SAMPLES = ["mlp", "cnn", "gpt", "llama", "moe"]
HF = ["llama", "gpt2", "t5", "mixtral", "bert"]
SEQ = 16


def _truth(loaded, target: str = "cpu", seq_len: int = SEQ) -> None:
    """Plan at world sizes 1, 2, 4, 8 against the converted step at 1 and 4,
    checkpointing on and off: to the byte (``helpers.plan_against_real_steps``)."""
    plan_against_real_steps(
        loaded,
        checkpointing=("none", "reentrant", "non-reentrant"),
        target=target,
        seq_len=seq_len,
    )


def test_plan_for_cuda_kernels_equals_the_fake_cuda_step(tmp_path):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    torch.manual_seed(0)
    tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    _truth(load_source(tmp_path), target="cuda", seq_len=256)


@pytest.mark.parametrize("name", SAMPLES)
def test_plan_peak_equals_real_profile_on_sample_models(name):
    _truth(load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}"))


@pytest.mark.parametrize("name", HF)
def test_plan_peak_equals_real_profile_on_tiny_hf_models(name, tmp_path):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    torch.manual_seed(0)
    tiny_model(name).save_pretrained(tmp_path)
    _truth(load_source(tmp_path))


def test_plan_json_follows_its_schema_and_marks_fits():
    result = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "sample_models.models:gpt",
            "--gpu-memory",
            "1500KiB",
            "--reserve",
            "0",
            "--world-size",
            "1,2,4",
            "--micro-batch",
            "1,2,4",
            "--seq-len",
            "16",
            "--target",
            "cpu",  # allocated bytes decide: no caching allocator's segments in the way
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["alloc_conf"] is None and doc["reserve_bytes"] == 0
    assert doc["schema"] == "yafsdp.plan/1"
    assert len(doc["rows"]) == 3 * 3 * 2
    for row in doc["rows"]:
        assert row["fits"] == (row["needed_bytes"] <= doc["gpu_memory_bytes"])
        parts = sum(row["breakdown"].values())
        assert parts == row["peak_bytes"]
    assert [ws for ws in (1, 2, 4) if any(r["fits"] for r in doc["rows"] if r["world_size"] == ws)]
    best = doc["best"]
    assert best["fits"]
    most = max(r["micro_batch"] for r in doc["rows"] if r["fits"])
    assert best["micro_batch"] == most
    # every cell measured, none carried: a run per cell; per micro-batch and
    # checkpointing, one step at world size 1 and one for world sizes 2 and 4
    assert doc["linearity"] == [] and doc["reserved_checks"] == []
    assert doc["fake_runs"] == len(doc["rows"]) and doc["fake_steps"] == 3 * 2 * 2
    assert all(r["measured"] and r["reserved_replayed"] for r in doc["rows"])


def test_plan_default_grid_stops_where_everything_fits():
    loaded = load_source(None, model="sample_models.models:gpt")
    opts = options(PlanOptions, gpu_memory=1536 * 2**10, reserve=0, seq_len=16, target="cpu")
    report = plan_model(loaded, opts)
    last = report.world_sizes[-1]
    assert all(r.fits for r in report.rows if r.world_size == last)
    assert not all(r.fits for r in report.rows if r.world_size == report.world_sizes[-2])
    assert report.world_sizes == tuple(2**k for k in range(len(report.world_sizes)))


def test_plan_markdown_and_html(tmp_path):
    page = tmp_path / "plan.html"
    result = runner.invoke(
        app,
        [
            "plan",
            "--model",
            "sample_models.models:mlp",
            "--gpu-memory",
            "1GiB",
            "--reserve",
            "0",
            "--world-size",
            "1,2",
            "--micro-batch",
            "1,2",
            "--format",
            "markdown",
            "--html",
            str(page),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "| GPUs | micro-batch 1 | micro-batch 2 |" in result.stdout
    assert "non-reentrant left out" in result.stdout  # the MLP has no repeated blocks
    html = page.read_text()
    assert 'id="plan"' in html and "<script src" not in html


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-memory", "lots"], "is not a size"),
        (["--gpu-memory", "1GiB", "--reserve", "2GiB"], "below --gpu-memory"),
        (["--gpu-memory", "80GiB", "--world-size", "0,2"], "positive integers"),
        (
            ["--gpu-memory", "80GiB", "--checkpointing", "all"],
            "not one of none|reentrant|non-reentrant",
        ),
        (["--gpu-memory", "80GiB", "--target", "tpu"], "--target 'tpu' is not cpu or cuda"),
        (["--gpu-memory", "80GiB", "--param-dtype", "int8"], "not a floating-point dtype"),
        ([], "give --gpu-memory"),
    ],
)
def test_plan_bad_input_is_one_line_exit_2(args, message):
    result = runner.invoke(app, ["plan", "--model", "sample_models.models:gpt", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("target", "rounding"), [("cpu", 1), ("cuda", 512)])
def test_plan_and_profile_round_every_storage_by_one_rule(target, rounding):
    """One cell, planned and profiled: the same rounding (1 B for the CPU's kernels,
    512 B for CUDA's) and so the same peak, to the byte."""
    model = ["sample_models/gpt.safetensors", "--model", "sample_models.models:gpt"]
    step = ["--target", target, "--seq-len", "16", "--param-dtype", "bf16"]
    plan = runner.invoke(
        app,
        ["plan", *model, *step, "--gpu-memory", "1TiB", "--world-size", "2"]
        + ["--micro-batch", "2", "--checkpointing", "none", "--json"],
    )
    assert plan.exit_code == 0, plan.output
    profile = runner.invoke(
        app,
        ["profile", *model, *step, "--fake", "-n", "2", "--batch", "2"]
        + ["--optimizer-impl", "foreach", "--json"],
    )
    assert profile.exit_code == 0, profile.output
    planned, profiled = json.loads(plan.stdout), json.loads(profile.stdout)
    assert planned["round_bytes"] == profiled["round_bytes"] == rounding
    (row,) = planned["rows"]
    assert row["peak_bytes"] == sum(profiled["converted"]["peak"].values())


def test_sizes_and_lists_parse():
    assert parse_size("80GiB", "--gpu-memory") == 80 * 2**30
    assert parse_size("80G", "--gpu-memory") == 80 * 2**30
    assert parse_size("80GB", "--gpu-memory") == 80 * 10**9
    assert parse_size("512 MiB", "--reserve") == 512 * 2**20
    assert parse_ints("1,2,2,4", "--world-size") == (1, 2, 4)
    with pytest.raises(YafsdpError, match="not a size"):
        parse_size("-1GiB", "--gpu-memory")


def test_check_takes_a_plan_baseline(tmp_path):
    args = ["--model", "sample_models.models:gpt", "--gpu-memory", "1500KiB", "--reserve", "0"]
    args += ["--target", "cpu"]
    grid = ["--world-size", "2,4", "--micro-batch", "1,2", "--seq-len", "16", "--json"]
    made = runner.invoke(app, ["plan", *args, *grid])
    assert made.exit_code == 0, made.output
    baseline = tmp_path / "plan.json"
    baseline.write_text(made.stdout)
    same = runner.invoke(app, ["check", "--baseline", str(baseline)])
    assert same.exit_code == 0, same.output
    assert "still fits" in same.stdout
    # the same plan on a smaller GPU: what fitted at 1500 KiB and not at 1100 KiB fails
    doc = json.loads(made.stdout)
    doc["options"]["gpu_memory"] = 1100 * 1024
    lost = [r for r in doc["rows"] if r["fits"] and r["needed_bytes"] > 1100 * 1024]
    assert lost
    baseline.write_text(json.dumps(doc))
    worse = runner.invoke(app, ["check", "--baseline", str(baseline)])
    assert worse.exit_code == 1, worse.output
    assert worse.stdout.count("regression:") == len(lost)


def test_plan_on_several_processes_equals_the_plan_in_one():
    """Workers load the source themselves and run some of the fake steps; the plan
    does not depend on where a step ran."""
    from yafsdp_cli.planning import plan_source

    base = dict(gpu_memory=2**30, reserve=0, world_sizes=(1, 2, 4), micro_batches=(1, 2, 4))
    kw = dict(model="sample_models.models:llama")
    one = plan_source(None, **kw, opts=options(PlanOptions, **base, seq_len=SEQ, jobs=1))
    two = plan_source(None, **kw, opts=options(PlanOptions, **base, seq_len=SEQ, jobs=2))
    assert one.rows == two.rows and one.fake_runs == two.fake_runs > 2
    assert any("(2 at a time" in n for n in two.notes)
    assert any("(1 at a time" in n for n in one.notes)


def test_a_failing_run_in_a_worker_is_the_plans_error():
    from yafsdp_cli.planning.cell import Cell
    from yafsdp_cli.planning.measure import measure_peaks
    from yafsdp_cli.planning.pool import Origin, run_steps

    opts = options(PlanOptions, gpu_memory=2**30, reserve=0, seq_len=SEQ)
    origin = Origin(None, "sample_models.models:mlp", False)
    loaded = load_source(None, model=origin.model)
    # the mlp has no units to checkpoint
    keys = [Cell.at(1, 1, "none"), Cell.at(1, 1, "non-reentrant"), Cell.at(1, 2, "non-reentrant")]
    with pytest.raises(YafsdpError, match="no repeated blocks to checkpoint"):
        run_steps(
            keys,
            lambda key: measure_peaks(loaded, opts, SEQ, key),
            jobs=2,
            origin=origin,
            measure=measure_peaks,
            worker_args=(opts, SEQ),
        )


def test_small_models_plan_in_one_process():
    from yafsdp_cli.planning.pool import PARALLEL_MODULES, auto_jobs

    assert auto_jobs(8, PARALLEL_MODULES - 1) == 1
    assert 1 <= auto_jobs(8, PARALLEL_MODULES) <= 8
    assert auto_jobs(1, 10_000) == 1


def test_the_default_grid_runs_on_past_cells_inside_the_margin():
    """A world size whose cells all fit but one only inside the margin is not enough:
    that cell cannot be the best row, so the grid goes on to a world size where it
    can (the 70B plan's micro-batch 8 fits at 128 GPUs only inside the margin)."""
    from types import SimpleNamespace as Ns

    from yafsdp_cli.memory.headroom import fit
    from yafsdp_cli.planning.fit_grid import _up_to_enough

    gib = 2**30
    gpu = 80 * gib
    opts = Ns(memory=Ns(gpu_memory=gpu, margin_bytes=2 * gib))
    needed = {(1, 1): 90, (1, 8): 95, (2, 1): 40, (2, 8): 79, (4, 1): 30, (4, 8): 70, (8, 1): 20}

    def rows():  # each row's Fit, as the plan gives it, under the options' margin
        return [
            Ns(
                world_size=ws,
                micro_batch=mb,
                fit=fit(n * gib, 0, 80 * gib, opts.memory.margin_bytes),
            )
            for (ws, mb), n in needed.items()
        ]

    assert sorted({r.world_size for r in _up_to_enough(rows(), opts)}) == [1, 2, 4]
    opts.memory.margin_bytes = 0  # then 2 GPUs, where everything fits, are enough
    assert sorted({r.world_size for r in _up_to_enough(rows(), opts)}) == [1, 2]


def test_a_sequence_past_the_models_positions_is_said_first(tmp_path):
    """A rotary model runs past its config's positions: the answer's assumed line
    says the plan's sequence is longer than the model was trained at, and the JSON
    carries the limit; at or under it, nothing is said. A learned table refuses."""
    pytest.importorskip("transformers")
    import transformers as tf

    from yafsdp_cli.report import plan_view

    config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=32)  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    base = dict(gpu_memory=2**30, reserve=0, world_sizes=(1,), micro_batches=(1,), jobs=1)
    for seq, said in ((64, True), (32, False)):
        report = plan_model(
            load_source(tmp_path / "llama"), options(PlanOptions, **base, seq_len=seq)
        )
        assumed = plan_view.answer(report)[-1]
        past = "past the 32 positions the model was trained at, config max_position_embeddings"
        assert (past in assumed) == said, assumed
        doc = json.loads(plan_view.to_json(report))
        jsonschema.validate(doc, SCHEMA)
        want = {"key": "max_position_embeddings", "positions": 32} if said else None
        assert doc["past_positions"] == want
    tf.GPT2Config(vocab_size=96, n_layer=2, n_embd=32, n_head=4, n_positions=16).save_pretrained(
        tmp_path / "gpt2"
    )
    args = ["--gpu-memory", "1GiB", "--seq-len", "64", "--world-size", "1", "--micro-batch", "1"]
    result = runner.invoke(app, ["plan", str(tmp_path / "gpt2"), *args])
    assert result.exit_code == 2
    assert "--seq-len 64 is longer than GPT2LMHeadModel takes: 16 positions" in result.output


def test_plan_peak_equals_real_profile_with_the_embedding_and_head_split_out():
    """Their own units: gathered and released around their own forward and backward by
    the runtime, never wrapped by checkpointing (which takes the blocks alone)."""
    loaded = load_source(None, model="stack_models:wide_llama")
    layout = plan(loaded.spec)
    assert layout.split == ("model.embed_tokens", "lm_head"), layout.units
    _truth(loaded)


def test_checkpointing_wraps_the_blocks_not_the_split_units():
    result = CliRunner().invoke(
        app,
        ["profile", "--model", "stack_models:wide_llama", "--checkpointing", "non-reentrant",
         "--seq-len", "16", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    assert "activation checkpointing: torch.utils.checkpoint (non-reentrant) around each of " \
        "2 units" in notes  # fmt: skip
