"""The step-time model's arithmetic: the roofline, the GPU table and its loader, the
exposed communication (the collectives: ``test_comm_volume.py``) and the
choice of the best configuration, each on a case worked by hand."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import options, run_gpu_bench_without_gpu

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import (
    GPUS,
    Efficiency,
    GpuSpec,
    StepEstimate,
    TimedCell,
    best_cell,
    exposed_time,
    gpu_spec,
    kernel_time,
    load_gpu,
)
from yafsdp_cli.timing.gpu_specs import SCHEMA_PATH, gpu_from_dict

GPU = GpuSpec("test", 2**30, 1e15, 2e15, 1e13, 2e12, 100e9, 8, "by hand")


# -- roofline --------------------------------------------------------------------------


def test_the_roofline_takes_the_slowest_resource_plus_the_floor():
    eff = Efficiency(matrix=0.5, vector=0.5, memory=0.5, kernel_floor_s=5e-6)
    # 1e12 FLOPs at 1e15 x 0.5 = 2 ms; 1e9 bytes at 2e12 x 0.5 = 1 ms
    t, bound = kernel_time(GPU, eff, matrix_flops=1e12, dtype="bfloat16", nbytes=1e9)
    assert (t, bound) == (pytest.approx(2e-3 + 5e-6), "matrix")
    t, bound = kernel_time(GPU, eff, matrix_flops=1e12, dtype="float8_e4m3fn", nbytes=2e9)
    assert (t, bound) == (pytest.approx(2e-3 + 5e-6), "memory")  # fp8 peak: 1 ms of FLOPs
    t, bound = kernel_time(GPU, eff, matrix_flops=1e10, dtype="float32")  # 1e13 x 0.5
    assert (t, bound) == (pytest.approx(2e-3 + 5e-6), "matrix")
    t, bound = kernel_time(GPU, eff, vector_flops=5e9, nbytes=1e6)  # 5e9 / 5e12
    assert (t, bound) == (pytest.approx(1e-3 + 5e-6), "vector")
    assert kernel_time(GPU, eff) == (pytest.approx(5e-6), "floor")


def test_efficiencies_are_checked():
    with pytest.raises(YafsdpError, match=r"efficiency matrix must be in \(0, 1\], got 1.5"):
        Efficiency(matrix=1.5)
    with pytest.raises(YafsdpError, match="kernel floor must be 0 or more"):
        Efficiency(kernel_floor_s=-1)


# -- GPU table and profiles --------------------------------------------------------------


def as_json(g: GpuSpec) -> dict:
    return {
        "name": g.name,
        "memory_bytes": g.memory_bytes,
        "bf16_tflops": g.bf16_flops / 1e12,
        "fp8_tflops": g.fp8_flops / 1e12,
        "fp32_tflops": g.fp32_flops / 1e12,
        "hbm_gbps": g.hbm_bytes_per_s / 1e9,
        "link_gbps": g.link_bytes_per_s / 1e9,
        "gpus_per_node": g.gpus_per_node,
        "source": g.source,
    }


def test_every_row_of_the_table_fits_the_schema_and_loads_back(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA_PATH.read_text())
    names = {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "MI300X"}
    assert {g.name for g in GPUS.values()} >= names
    for g in GPUS.values():
        doc = as_json(g)
        jsonschema.validate(doc, schema)
        path = tmp_path / f"{g.name}.json"
        path.write_text(json.dumps(doc))
        back = load_gpu(path)
        assert back.name == g.name and back.memory_bytes == g.memory_bytes
        assert back.bf16_flops == pytest.approx(g.bf16_flops)
        assert g.source and g.fp32_flops < g.bf16_flops


def test_h100_memory_is_what_the_driver_reports():
    assert gpu_spec("H100-SXM").memory_bytes == 81559 * 2**20
    assert gpu_spec("h200").name == "H200" and gpu_spec("MI300x").name == "MI300X"


def test_an_unknown_gpu_lists_the_known_names():
    with pytest.raises(YafsdpError, match=r"unknown GPU 'H300'; known: A100-40GB, .*MI300X"):
        gpu_spec("H300")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bf16_tflops": None}, "missing field 'bf16_tflops'"),
        ({"hbm_gbps": "fast"}, "'hbm_gbps' must be a number, got 'fast'"),
        ({"gpus_per_node": 8.5}, "'gpus_per_node' must be an integer, got 8.5"),
        ({"memory_bytes": True}, "'memory_bytes' must be an integer, got True"),
        ({"link_gbps": 0}, "'link_gbps' must be positive, got 0"),
        ({"name": " "}, "'name' must not be empty"),
        ({"tflops": 3}, "unknown field 'tflops'"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_field(tmp_path, change, message):
    doc = {**as_json(GPU), **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(YafsdpError, match=f"^{path}: {message}") as info:
        load_gpu(path)
    assert "\n" not in str(info.value)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(YafsdpError, match="none.json: cannot read"):
        load_gpu(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(YafsdpError, match=r"bad.json: not valid JSON \("):
        load_gpu(tmp_path / "bad.json")
    with pytest.raises(YafsdpError, match="a GPU profile is a JSON object, got list"):
        gpu_from_dict([1])


# -- communication -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_spec():
    return load_source(None, model="sample_models.models:llama").spec


def test_exposed_communication_with_one_unit_prefetched():
    # forward: unit 0's gather (0.5) waits; unit 1's (2) hides 1 behind unit 0's compute
    assert exposed_time([1, 1, 1], [0.5, 2, 0.5], [0, 0, 0]) == pytest.approx(1.5)
    # backward: unit k's reduce (after) and unit k+2's gather overlap unit k+1's compute
    assert exposed_time([1, 1, 1], [0.2, 0.3, 0.3], [0.6, 0.6, 0.4]) == pytest.approx(0.2 + 0.4)
    assert exposed_time([], [], []) == 0


# -- choosing ------------------------------------------------------------------------------


def cell(n: int, tokens_per_s: float, fits: bool = True, ckpt: str = "none") -> TimedCell:
    est = StepEstimate("test", "yafsdp", n, 1000, 0, 0, 0, 0, 0, 1000 / tokens_per_s,
                       tokens_per_s, 0.5, 0, 0)  # fmt: skip
    return TimedCell(n, 1, ckpt, fits, est)


GRID = [cell(4, 2000, fits=False), cell(8, 1000), cell(16, 1200, ckpt="non-reentrant"),
        cell(16, 1200), cell(32, 1200)]  # fmt: skip


def test_the_best_row_under_each_objective():
    best = best_cell(GRID)  # throughput by default
    assert (best.cell.world_size, best.cell.checkpointing, best.objective) == (
        16,
        "none",
        "throughput",
    )
    hours = best_cell(GRID, "gpu-hours", tokens=1200 * 3600 * 1000)
    assert hours.cell.world_size == 32  # as few GPU-hours as 16, and sooner
    assert hours.gpu_hours == pytest.approx(1000) and hours.wall_hours == pytest.approx(1000 / 32)
    assert best_cell(GRID, "fewest-gpus").cell.world_size == 8
    assert best_cell([cell(4, 2000, fits=False)]) is None


def test_objectives_are_checked():
    with pytest.raises(YafsdpError, match="objective gpu-hours needs the number of tokens"):
        best_cell(GRID, "gpu-hours")
    with pytest.raises(YafsdpError, match="objective 'cost' is not one of"):
        best_cell(GRID, "cost")


# -- the GPU benchmark without a GPU ---------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the bench would run")
def test_the_step_time_bench_skips_without_a_gpu(tmp_path):
    _, body = run_gpu_bench_without_gpu("bench_step_time_cuda", tmp_path / "step_time.json")
    assert body["skipped"] == "no CUDA device"


# -- a whole estimate --------------------------------------------------------------------


def test_a_step_estimate_adds_up(llama_spec):
    from yafsdp_cli.profiling import ProfileOptions
    from yafsdp_cli.timing import count_step, estimate_step

    loaded = load_source(None, model="sample_models.models:llama")
    costs = count_step(
        loaded, options(ProfileOptions, fake=True, target="cuda", batch=2, seq_len=64)
    )
    gpu = gpu_spec("H100-SXM")
    one = estimate_step(costs, plan(llama_spec, LayoutOptions(world_size=1)), gpu)
    assert one.comm_s == one.exposed_comm_s == one.sent_bytes == 0
    assert one.step_s == pytest.approx(one.forward_s + one.backward_s + one.optimizer_s)
    assert one.tokens_per_s == pytest.approx(128 / one.step_s)
    assert one.mfu == pytest.approx(
        costs.model_flops / (gpu.bf16_flops * one.step_s)
    )  # bf16 products
    for scheme in ("yafsdp", "fsdp2", "ddp"):
        est = estimate_step(
            costs, plan(llama_spec, LayoutOptions(world_size=4)), gpu, scheme=scheme
        )
        assert 0 < est.exposed_comm_s <= est.comm_s
        assert est.step_s == pytest.approx(
            est.forward_s + est.backward_s + est.exposed_comm_s + est.optimizer_s
        )
        assert (est.optimizer_s < one.optimizer_s) == (scheme != "ddp")
