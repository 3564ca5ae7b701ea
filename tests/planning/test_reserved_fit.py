"""``plan`` decides fit on the caching allocator's reserved peak plus the memory beside
the allocator: small cases whose figures follow from the cell's own replay."""

from __future__ import annotations

import gc
import json
import weakref
from importlib import resources

import jsonschema
import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.memory import outside_memory, reserved_of
from yafsdp_cli.options.sizes import parse_margin, parse_outside
from yafsdp_cli.planning import PlanOptions, plan_model
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.profiling.profiler import profile_converted
from yafsdp_cli.sources import load_source

runner = CliRunner()
SCHEMA = json.loads(resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text())
MIB = 1 << 20
SEQ = 256
CELL = (2, 8, "non-reentrant")  # (world size, micro-batch, checkpointing)
EXPANDABLE = "expandable_segments:True"


@pytest.fixture(autouse=True)
def no_alloc_conf(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").to(torch.bfloat16).save_pretrained(path)
    return load_source(path)


def cell_replay(loaded, ws: int, mb: int, ck: str, conf: str | None = None):
    """The cell's own fake step, replayed: (allocated peak, reserved peak)."""
    traces: dict = {}
    step = profile_converted(
        loaded,
        options(
            ProfileOptions,
            world_size=ws,
            batch=mb,
            seq_len=SEQ,
            fake=True,
            target="cuda",
            param_dtype="bf16",
            checkpointing=ck,
            round_bytes=512,
            optimizer_impl="foreach",
        ),
        traces=traces,
    )
    return step.peak.total, reserved_of(traces["converted"], conf).reserved_peak


def one_cell(loaded, gpu: int, **kw):
    """A plan of ``CELL`` alone (measured: its own run decides)."""
    ws, mb, ck = CELL
    base = dict(world_sizes=(ws,), micro_batches=(mb,), checkpointing=(ck,), seq_len=SEQ)
    report = plan_model(loaded, options(PlanOptions, gpu_memory=gpu, jobs=1, **{**base, **kw}))
    (row,) = report.rows
    return report, row


def test_a_cell_that_fits_on_allocated_but_not_on_reserved(llama):
    peak, reserved = cell_replay(llama, *CELL)
    assert reserved > peak  # the 2 MiB segments leave free bytes no request fits
    gpu = (peak + reserved) // 2
    report, row = one_cell(llama, gpu, reserve=0, margin=0, alloc_conf="")
    assert row.peak_bytes == peak and row.reserved_bytes == reserved
    assert row.fragmentation_bytes == reserved - peak
    assert row.needed_bytes == reserved
    assert row.peak_bytes <= gpu and not row.fits
    _, roomy = one_cell(llama, reserved, reserve=0, margin=0, alloc_conf="")
    assert roomy.fits and roomy.needed_bytes == reserved


def test_a_cell_that_fits_only_with_expandable_segments(llama):
    peak, default = cell_replay(llama, *CELL)
    _, grown = cell_replay(llama, *CELL, EXPANDABLE)
    assert grown < default
    gpu = (grown + default) // 2
    report, row = one_cell(llama, gpu, reserve=0, margin=0)
    assert report.alloc_conf == "default" and not row.fits
    assert row.fits_with.alloc_conf == EXPANDABLE
    assert row.fits_with.reserved_bytes == row.fits_with.needed_bytes == grown
    assert row.fits_with.export == f"export PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}"
    assert report.best is None and report.advice.row == row
    # the job already has the setting: the row fits, nothing to advise
    given, same = one_cell(llama, gpu, reserve=0, margin=0, alloc_conf=EXPANDABLE)
    assert same.fits and same.reserved_bytes == grown and same.fits_with is None
    assert given.advice is None and given.best == same
    # the variable is read when --alloc-conf is not given
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
        assert one_cell(llama, gpu, reserve=0, margin=0)[1].fits


def test_outside_parts_are_itemised_and_overridable(llama):
    peak, reserved = cell_replay(llama, *CELL)
    _, row = one_cell(llama, 80 << 30, outside=(("context", 100 * MIB), ("nccl", 0)))
    parts = {p.name: p for p in row.outside}
    expect = outside_memory(torch_version=torch.__version__, world_size=CELL[0], env={})
    assert parts["CUDA context"].bytes == 100 * MIB and parts["CUDA context"].source == "given"
    assert parts["NCCL buffers"].bytes == 0
    assert parts["cuBLAS workspaces"].bytes == expect.parts[1].bytes > 0
    assert row.needed_bytes == reserved + sum(p.bytes for p in row.outside)
    _, whole = one_cell(llama, 80 << 30, reserve=1 << 30)
    assert [(p.name, p.bytes) for p in whole.outside] == [("reserve", 1 << 30)]
    assert whole.needed_bytes == reserved + (1 << 30)


def test_the_best_row_keeps_the_margin(llama):
    opts = dict(world_sizes=(1, 2), micro_batches=(1, 2, 4), seq_len=SEQ, reserve=0, jobs=1)
    free = plan_model(llama, options(PlanOptions, gpu_memory=64 * MIB, margin=0, **opts))
    best = free.best
    left = free.gpu_memory_bytes - best.needed_bytes
    kept = plan_model(llama, options(PlanOptions, gpu_memory=64 * MIB, margin=left + 1, **opts))
    assert kept.margin_bytes == left + 1
    assert kept.best != best
    assert kept.best is None or kept.gpu_memory_bytes - kept.best.needed_bytes > left
    default = options(PlanOptions, gpu_memory=80 << 30)
    assert default.memory.margin_bytes == round(0.03 * (80 << 30))


def test_every_cell_is_its_own_steps_replay(llama):
    """Every row's allocated and reserved peaks, and its advised setting's reserved
    peak where it has one, are those of a direct replay of the cell's own fake step."""
    _, default = cell_replay(llama, *CELL)
    _, grown = cell_replay(llama, *CELL, EXPANDABLE)
    opts = options(
        PlanOptions,
        gpu_memory=(default + grown) // 2,  # CELL fits only with expandable segments
        reserve=0,
        margin=0,
        world_sizes=(1, 2, 4),
        micro_batches=(1, 2, 4, 8),
        seq_len=SEQ,
        jobs=1,
    )
    report = plan_model(llama, opts)
    assert len(report.rows) == 3 * 4 * 2 == report.fake_runs
    for r in report.rows:
        peak, reserved = cell_replay(llama, r.world_size, r.micro_batch, r.checkpointing)
        assert (r.peak_bytes, r.reserved_bytes) == (peak, reserved), r.cell
        assert r.fragmentation_bytes == reserved - peak
        if r.fits_with is not None:
            _, grown = cell_replay(llama, *key(r), EXPANDABLE)
            assert r.fits_with.reserved_bytes == grown
    assert any(r.fits_with is not None for r in report.rows)
    assert any(r.fits for r in report.rows) and not all(r.fits for r in report.rows)


def test_a_cell_reads_the_same_in_any_grid_and_objective(llama):
    """A cell's figures do not depend on what else the plan is asked: each cell of a
    grid equals the same cell asked alone, and the grid under another objective."""
    base = dict(reserve=0, margin=0, seq_len=SEQ, jobs=1, gpu="h100-sxm", gpu_memory=8 * MIB)
    grid = dict(world_sizes=(1, 2, 8), micro_batches=(1, 2, 8))
    full = plan_model(llama, options(PlanOptions, **base, **grid))
    hours = plan_model(
        llama, options(PlanOptions, **base, **grid, objective="gpu-hours", tokens=10**9)
    )
    assert [_figures(r) for r in full.rows] == [_figures(r) for r in hours.rows]
    for r in full.rows:
        ws, mb, ck = key(r)
        (alone,) = plan_model(
            llama,
            options(
                PlanOptions, **base, world_sizes=(ws,), micro_batches=(mb,), checkpointing=(ck,)
            ),
        ).rows
        assert _figures(alone) == _figures(r), key(r)


def key(r) -> tuple[int, int, str]:
    return r.world_size, r.micro_batch, r.checkpointing


def _figures(r) -> tuple:
    return (key(r), r.peak_bytes, r.reserved_bytes, r.needed_bytes, r.fits, r.breakdown)


def test_plan_json_carries_the_reserved_figures():
    args = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "200MiB", "--seq-len"]
    args += ["64", "--world-size", "1,2", "--micro-batch", "1,2,4", "--outside", "context=0"]
    result = runner.invoke(app, [*args, "--margin", "5%", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["margin_bytes"] == round(0.05 * 200 * MIB) and doc["reserve_bytes"] is None
    for row in doc["rows"]:
        outside = sum(p["bytes"] for p in row["outside"])
        assert row["needed_bytes"] == row["reserved_bytes"] + outside
        assert row["reserved_bytes"] == row["peak_bytes"] + row["fragmentation_bytes"]
        assert row["fits"] == (row["needed_bytes"] <= doc["gpu_memory_bytes"])
        assert row["outside"][0] == {"name": "CUDA context", "bytes": 0, "source": "given"}
    best = doc["best"]
    assert best["reserved_replayed"]
    assert doc["gpu_memory_bytes"] - best["needed_bytes"] >= doc["margin_bytes"]


def test_plan_markdown_table_and_html_show_each_part(tmp_path):
    page = tmp_path / "plan.html"
    args = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "2GiB"]
    args += ["--seq-len", "64", "--world-size", "1,2", "--micro-batch", "1,2"]
    md = runner.invoke(app, [*args, "--format", "markdown", "--html", str(page)])
    assert md.exit_code == 0, md.output
    head = "| world size | micro-batch | checkpointing | allocated | reserved | fragmentation |"
    assert head in md.stdout
    for part in ("CUDA context", "cuBLAS workspaces", "cuBLASLt workspaces", "NCCL buffers"):
        assert part in md.stdout and part in page.read_text()
    assert "needed" in md.stdout and "margin" in md.stdout
    table = runner.invoke(app, args)
    assert table.exit_code == 0, table.output
    assert table.stdout.startswith("fewest GPUs: ") and "needed per rank" in table.stdout
    assert "best: world size" not in table.stdout  # the method lines wait for --explain
    explained = runner.invoke(app, [*args, "--explain"])
    assert explained.exit_code == 0, explained.output
    assert "best: world size" in explained.stdout and "CUDA context" in explained.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--outside", "gpu=1GiB"], "PART=SIZE pairs"),
        (["--outside", "context"], "PART=SIZE pairs"),
        (["--outside", "nccl=lots"], "is not a size"),
        (["--margin", "120%"], "a share is a number from 0 to 100"),
        (["--margin", "90GiB"], "--margin 96636764160 bytes must be at least 0 and below"),
        (["--alloc-conf", "expandable_segments:Maybe"], "expandable_segments"),
    ],
)
def test_bad_parts_margin_and_settings_are_one_line_exit_2(args, message):
    base = ["plan", "--model", "sample_models.models:gpt", "--gpu-memory", "80GiB"]
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_parts_and_margin_parse():
    assert parse_outside("context=1GiB, nccl=0") == (("context", 1 << 30), ("nccl", 0))
    assert parse_outside(None) == ()
    assert parse_margin("5%", 100) == 5 and parse_margin("2KiB", 100) == 2048
    assert parse_margin(None, 100) is None
    with pytest.raises(YafsdpError, match="give bytes of at least 0"):
        options(PlanOptions, gpu_memory=1 << 30, outside=(("context", -1),))


def tensors_alive() -> int:
    gc.collect()
    kinds = (torch.Tensor, torch.nn.Module)
    return sum(1 for o in gc.get_objects() if issubclass(type(o), kinds))


def test_nothing_of_a_plan_outlives_it_with_replays_and_advice(llama, monkeypatch):
    """The fake runs' modules and tensors, the traces they replay, the settled rows and
    the advice: nothing of them is alive after the plan, call after call."""
    from yafsdp_cli.profiling import profiler

    refs: list[weakref.ref] = []
    build = profiler.build_module

    def tracked(*args, **kwargs):
        module = build(*args, **kwargs)
        refs.append(weakref.ref(module))
        refs.extend(weakref.ref(t) for t in (*module.parameters(), *module.buffers()))
        return module

    monkeypatch.setattr(profiler, "build_module", tracked)
    _, default = cell_replay(llama, *CELL)
    opts = dict(reserve=0, margin=0)
    one_cell(llama, default - 1, **opts)  # first call: caches torch fills once
    base = tensors_alive()
    for _ in range(3):
        report, row = one_cell(llama, default - 1, **opts)
        assert row.fits_with is not None and report.advice is not None  # advice ran
        del report, row
    assert tensors_alive() == base
    assert len(refs) >= 4 and [r for r in refs if r() is not None] == []
