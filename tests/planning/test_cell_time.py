"""``plan`` with a GPU: every cell's step time against the timing package's own
estimate of that cell, the kernel line across micro-batches against a direct count,
the best row under each objective, and the options that name the GPU."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import jsonschema
import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine.plan import plan
from yafsdp_cli.engine.records import retype_params
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.planning import PlanOptions, PlanRow, plan_model
from yafsdp_cli.planning.cell import Cell
from yafsdp_cli.planning.cell_time import (
    CellTimer,
    best_timed,
    count_cell,
    count_points,
    interpolate,
    ranked_rows,
    timing_setup,
)
from yafsdp_cli.planning.plan_options import parse_count, parse_rate
from yafsdp_cli.planning.plan_report import PlanBreakdown
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import Cluster, Efficiency, StepEstimate, estimate_step, gpu_spec
from yafsdp_cli.timing.gpu_profile import GpuProfile, profile_to_dict

SEQ = 64


@pytest.fixture(scope="module")
def llama():
    return load_source(None, model="sample_models.models:llama")


@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant"])
def test_the_kernel_line_equals_a_direct_count(llama, checkpointing):
    opts = options(PlanOptions, gpu="h100-sxm", seq_len=SEQ)
    one, two, five = (
        count_cell(llama, opts, SEQ, Cell.at(1, mb, checkpointing)) for mb in (1, 2, 5)
    )
    assert one.ops != two.ops  # the counts do grow with the batch
    line = interpolate(one, two, 1, 2, 5)
    assert len(line.ops) == len(five.ops) and line.tokens == five.tokens == 5 * SEQ
    kinked = []
    for got, want in zip(line.ops, five.ops):
        # FLOPs and bytes are on the line exactly; a vector count is the larger side
        # of the op, which bends where the batch's side overtakes the weight's (the
        # embedding's backward: the table's rows or the tokens', whichever is more)
        assert dataclasses.replace(got, vector_flops=0) == dataclasses.replace(want, vector_flops=0)
        if got.vector_flops != want.vector_flops:
            kinked.append(got.name)
    assert set(kinked) <= {"aten.embedding_dense_backward.default"}
    gpu, layout = gpu_spec("h100-sxm"), plan(llama.spec, LayoutOptions(world_size=1))
    got, want = (estimate_step(c, layout, gpu).step_s for c in (line, five))
    assert got == pytest.approx(want, rel=1e-6)  # memory-bound: the bend costs no time


def test_kernels_that_differ_are_not_put_on_a_line(llama):
    opts = options(PlanOptions, gpu="h100-sxm", seq_len=SEQ)
    plain, ckpt = (
        count_cell(llama, opts, SEQ, Cell.at(1, 1, c)) for c in ("none", "non-reentrant")
    )
    assert interpolate(plain, ckpt, 1, 2, 3) is None


def test_every_cell_is_the_timing_packages_estimate_of_it(llama):
    network = 25e9
    opts = options(
        PlanOptions,
        gpu="h100-sxm",
        seq_len=SEQ,
        world_sizes=(1, 4, 16),
        micro_batches=(1, 2, 4),
        network=network,
        jobs=1,
    )
    report = plan_model(llama, opts)
    assert opts.memory.gpu_memory == gpu_spec("h100-sxm").memory_bytes  # --gpu sets it
    # every micro-batch of (1, 2, 4) is a count point, for each checkpointing choice
    assert report.timing.gpu == "H100-SXM" and report.timing.count_runs == 3 * 2
    spec = retype_params(llama.spec, "bfloat16")
    for ws, mb, ck in [(4, 4, "non-reentrant"), (16, 1, "none"), (1, 2, "none")]:
        at = {(r.world_size, r.micro_batch, r.checkpointing): r for r in report.rows}
        row = at[(ws, mb, ck)]
        costs = count_cell(llama, opts, SEQ, Cell.at(ws, mb, ck))
        want = estimate_step(
            costs,
            plan(spec, LayoutOptions(world_size=ws, align=opts.layout.align)),
            gpu_spec("h100-sxm"),
            cluster=Cluster(inter_node_bytes_per_s=network),
            cfg=opts.memory_config(),
        )
        assert row.time == pytest.approx(want), (ws, mb, ck)
        assert row.time.tokens_per_s == pytest.approx(mb * SEQ / row.time.step_s)
    # 16 ranks span two nodes of 8: some communication shows
    assert next(r for r in report.rows if r.world_size == 16).time.exposed_comm_s > 0


def row(ws: int, mb: int, tokens_per_s: float, fits: bool = True, ck: str = "none") -> PlanRow:
    est = StepEstimate("test", "yafsdp", ws, mb * 100, 0, 0, 0, 0, 0, mb * 100 / tokens_per_s,
                       tokens_per_s, 0.4, 0, 0)  # fmt: skip
    zero = PlanBreakdown(*[0] * 9)
    return PlanRow(ws, mb, 100, ck, 1, 1, zero, "backward", fits, 1, 0, (), None, time=est)


ROWS = [
    row(2, 8, 5000, fits=False),  # fastest, but does not fit
    row(4, 1, 1000),
    row(4, 4, 2800, ck="non-reentrant"),
    row(8, 2, 3000, ck="non-reentrant"),
    row(8, 4, 3000),
    row(16, 8, 3000),
    row(8, 8, 2500),
]


@pytest.mark.parametrize(
    ("objective", "tokens", "want"),
    [
        (None, None, (8, 4, "none")),  # throughput: ties to fewer GPUs, then no recompute
        ("throughput", None, (8, 4, "none")),
        ("gpu-hours", 3000 * 3600 * 64, (16, 8, "none")),  # as cheap as 8 GPUs, sooner
        ("fewest-gpus", None, (4, 4, "non-reentrant")),  # 4 GPUs, the faster of the two
    ],
)
def test_the_best_row_under_each_objective(objective, tokens, want):
    best, gpu_h, wall_h = best_timed(ROWS, objective, tokens)
    assert (best.world_size, best.micro_batch, best.checkpointing) == want
    if tokens:
        assert gpu_h == pytest.approx(64) and wall_h == pytest.approx(4)
    assert best_timed([r for r in ROWS if not r.fits], objective, tokens) is None


def test_speeds_within_one_percent_are_a_tie():
    near = [row(64, 8, 948.0), row(256, 8, 948.5), row(512, 8, 949.0)]
    assert best_timed(near, "throughput", None)[0].world_size == 64  # fewer GPUs
    assert best_timed(near, "gpu-hours", 10**9)[0].world_size == 512  # sooner
    apart = [row(64, 8, 930.0), row(256, 8, 949.0)]  # 2% apart: the faster
    assert best_timed(apart, "throughput", None)[0].world_size == 256
    # the table's order: the tie at the top by world size, then the slower by speed
    assert [r.world_size for r in ranked_rows([*near, *apart], "throughput")] == [
        64, 256, 256, 512, 64
    ]  # fmt: skip


def test_untimed_rows_cannot_be_chosen_by_an_objective():
    with pytest.raises(YafsdpError, match="needs every row timed"):
        best_timed([dataclasses.replace(ROWS[1], time=None)], None, None)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gpu_memory": 2**34, "objective": "throughput"}, "--objective needs the GPU"),
        ({"gpu_memory": 2**34, "network": 1e9}, "--network needs the GPU"),
        ({"gpu": "h100-sxm", "gpu_profile": "x.json"}, "--gpu or --gpu-profile, not both"),
        ({"gpu": "h100-sxm", "objective": "cost"}, "--objective 'cost' is not one of"),
        ({"gpu": "h100-sxm", "objective": "gpu-hours"}, "gpu-hours needs --tokens"),
        ({"gpu": "h100-sxm", "tokens": 0}, "--tokens must be at least 1"),
        ({"gpu": "h100-sxm", "network": -1.0}, "--network must be positive"),
        ({"gpu": "v100"}, "unknown GPU 'v100'; known: A100-40GB"),
        ({}, r"give --gpu-memory.*\(or --gpu NAME\)"),
    ],
)
def test_timing_options_are_checked_before_any_run(given, message):
    with pytest.raises(YafsdpError, match=message):
        options(PlanOptions, **given)


def test_given_gpu_memory_wins_over_the_gpus():
    assert options(PlanOptions, gpu="h200", gpu_memory=2**36).memory.gpu_memory == 2**36
    assert options(PlanOptions, gpu="H200").memory.gpu_memory == gpu_spec("h200").memory_bytes


# -- the command line ----------------------------------------------------------------------

runner = CliRunner()
PLAN_SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text()
)
GPT = ["plan", "--model", "sample_models.models:gpt", "--seq-len", "32", "--world-size", "1,16",
       "--micro-batch", "1,2,3", "--checkpointing", "none"]  # fmt: skip


def test_plan_json_carries_the_time_of_every_cell():
    result = runner.invoke(
        app,
        [
            *GPT,
            "--gpu",
            "a100-80gb",
            "--network",
            "400Gbit/s",
            "--tokens",
            "1B",
            "--objective",
            "gpu-hours",
            "--json",
        ],  # fmt: skip
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, PLAN_SCHEMA)
    t = doc["timing"]
    assert t["gpu"] == "A100-80GB" and t["network_bytes_per_s"] == 50e9
    assert t["objective"] == "gpu-hours" and t["tokens"] == 10**9
    assert doc["gpu_memory_bytes"] == gpu_spec("a100-80gb").memory_bytes
    for r in doc["rows"]:
        time = r["time"]
        assert time["step_s"] > 0 and 0 < time["mfu"] < 1
        assert time["tokens_per_s"] == pytest.approx(time["tokens"] / time["step_s"])
        assert time["exposed_share"] == pytest.approx(time["exposed_comm_s"] / time["step_s"])
        compute = time["forward_s"] + time["backward_s"] + time["optimizer_s"]
        assert sum(time["compute_bound_s"].values()) == pytest.approx(compute)
        outlasts = time["comm_s"] > time["forward_s"] + time["backward_s"]
        assert time["decided_by"] == ("communication" if outlasts else "compute")
    fitting = [r for r in doc["rows"] if r["fits"]]
    best = max(fitting, key=lambda r: (r["time"]["tokens_per_s"], r["world_size"]))
    assert doc["best"] == best
    assert t["gpu_hours"] == pytest.approx(10**9 / best["time"]["tokens_per_s"] / 3600)


def test_plan_without_a_gpu_has_no_time():
    result = runner.invoke(app, [*GPT, "--gpu-memory", "4GiB", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, PLAN_SCHEMA)
    assert doc["timing"] is None and all(r["time"] is None for r in doc["rows"])


def test_plan_markdown_table_and_html_show_the_time_columns(tmp_path):
    page = tmp_path / "plan.html"
    for fmt in ("markdown", "table"):
        args = [*GPT, "--gpu", "h100-sxm", "--format", fmt, "--html", str(page), "--explain"]
        result = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        # the table's headers are two lines ("tokens/s" over "per GPU"), markdown's one
        words = ("tokens/s", "per GPU", "MFU", "exposed", "comm", "fastest by throughput")
        for column in words:
            assert column in result.output, (fmt, column)
        flat = " ".join(result.stdout.split())  # the answer wraps at the console's width
        reason = flat[flat.index("recommended:") : flat.index("assumed:")]
        assert "tokens/s per GPU" in reason  # the answer says why
        # --explain says where the best row's step goes and what decides it
        goes = flat[flat.index("where the step goes: compute") :]
        assert "launch floors" in goes and "decides the step" in goes
    html = page.read_text()
    assert 'id="time"' in html and "tokens/s per GPU" in html


def test_a_gpu_profile_times_the_plan(tmp_path):
    doc = profile_to_dict(
        GpuProfile(gpu_spec("h100-sxm"), Efficiency(matrix=0.3, memory=0.4, kernel_floor_s=1e-5))
    )
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**doc, "name": "slow-h100"}))
    fast, slow = (
        json.loads(runner.invoke(app, [*GPT, *gpu, "--json"]).stdout)
        for gpu in (["--gpu", "h100-sxm"], ["--gpu-profile", str(path)])
    )
    assert slow["timing"]["gpu"] == "slow-h100" and slow["timing"]["efficiency"]["matrix"] == 0.3
    assert all(
        s["time"]["step_s"] > f["time"]["step_s"] for s, f in zip(slow["rows"], fast["rows"])
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "gpu.json: not valid JSON"),
        ('{"name": "x"}', "missing field 'memory_bytes'"),
        (None, "gpu.json: cannot read"),
    ],
)
def test_a_bad_gpu_profile_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "gpu.json"
    if content is not None:
        path.write_text(content)
    result = runner.invoke(app, [*GPT, "--gpu-profile", str(path), "--json"])
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "h100-sxm", "--network", "fast"], "--network 'fast' is not a bandwidth"),
        (["--gpu", "h100-sxm", "--tokens", "lots"], "--tokens 'lots' is not a count"),
        (["--gpu", "h100-sxm", "--objective", "gpu-hours"], "gpu-hours needs --tokens"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--gpu-memory", "80GiB", "--objective", "throughput"], "--objective needs the GPU"),
    ],
)
def test_bad_timing_flags_are_one_line_exit_2(args, message):
    result = runner.invoke(app, [*GPT, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_rates_and_counts_parse():
    assert parse_rate("50GB/s", "--network") == 50e9
    assert parse_rate("400 Gbit/s", "--network") == 50e9
    assert parse_rate("1GiB/s", "--network") == 2**30
    assert parse_count("2T", "--tokens") == 2 * 10**12
    assert parse_count("300B", "--tokens") == 3 * 10**11
    assert parse_count("2e12", "--tokens") == 2 * 10**12
    assert parse_rate(None, "--network") is None and parse_count(None, "--tokens") is None


def test_count_points_keep_a_batch_of_one_apart():
    assert count_points([8, 1, 4, 2]) == [1, 2, 4]
    assert count_points([2, 4, 8, 16]) == [2, 4]
    assert count_points([1]) == [1] and count_points([4]) == [4]


def test_a_loss_that_copies_its_labels_above_one_sequence_still_takes_the_line(tmp_path):
    """transformers' causal loss copies its shifted labels at two sequences and not at
    one: the counts at 1 and 2 differ, and the plan's first counts must still serve
    every larger micro-batch, each equal to its own count (no count made later)."""
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(tmp_path)
    loaded = load_source(tmp_path)
    opts = options(PlanOptions, gpu="h100-sxm", seq_len=SEQ, loss="model")
    one, two = (count_cell(loaded, opts, SEQ, Cell.at(1, mb, "none")) for mb in (1, 2))
    assert interpolate(one, two, 1, 2, 4) is None  # the case this rule is for
    timer = CellTimer(loaded, opts, SEQ, timing_setup(opts), None)
    timer.count([1, 2, 4, 8], ["none"])
    assert sorted(c.micro_batch for c in timer.counts) == [1, 2, 4]
    eight = timer.costs(8, "none")
    assert timer.runs == 3
    direct = count_cell(loaded, opts, SEQ, Cell.at(1, 8, "none"))
    gpu, layout = gpu_spec("h100-sxm"), plan(loaded.spec, LayoutOptions(world_size=1))
    assert estimate_step(eight, layout, gpu).step_s == pytest.approx(
        estimate_step(direct, layout, gpu).step_s, rel=1e-9
    )
    assert eight.phase("forward").matrix_flops == direct.phase("forward").matrix_flops
