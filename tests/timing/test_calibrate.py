"""``yafsdp calibrate``: its measurements run on the CPU with the device passed in, the
profile they make follows the schema, loads back and times a plan; without a GPU the
command says so in one line."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch
from helpers import options
from torch import nn
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import gpu_spec, resolve_gpu
from yafsdp_cli.timing.calibrate import (
    MatmulRate,
    hbm_bandwidth,
    measure,
    table_gpu,
    time_matmul,
    training_matmuls,
)
from yafsdp_cli.timing.gpu_profile import (
    load_profile,
    profile_from_dict,
    profile_to_dict,
    write_profile,
)
from yafsdp_cli.timing.gpu_specs import SCHEMA_PATH

runner = CliRunner()
GPU_SCHEMA = json.loads(SCHEMA_PATH.read_text())


@pytest.fixture(scope="module")
def measured():
    loaded = load_source(None, model="sample_models.models:llama")
    opts = options(ProfileOptions,
        device="cpu", target="cpu", batch=2, seq_len=32, param_dtype="bf16",
        optimizer_impl="foreach",
    )  # fmt: skip
    base = gpu_spec("h100-sxm")
    return measure(loaded, opts, "cpu", base, warmup=1, steps=3, repeat=2, copy_bytes=1 << 22)


def test_the_profile_follows_the_schema_and_loads_back(measured, tmp_path):
    path = tmp_path / "gpu.json"
    write_profile(path, measured.profile)
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, GPU_SCHEMA)
    back = load_profile(path)
    assert back.gpu == measured.profile.gpu and back.calibration == measured.profile.calibration
    # the floor is written in microseconds: equal to the last bit or so
    want = measured.profile.efficiency
    assert back.efficiency.matrix == want.matrix and back.efficiency.memory == want.memory
    assert back.efficiency.kernel_floor_s == pytest.approx(want.kernel_floor_s, rel=1e-12)
    assert doc["name"] == "H100-SXM-calibrated" and doc["calibration"]["device"] == "cpu"
    assert doc["bf16_tflops"] == 989.4  # the datasheet's; the efficiencies are measured


def test_the_efficiencies_are_what_was_measured(measured):
    eff, base = measured.profile.efficiency, gpu_spec("h100-sxm")
    flops = sum(2 * r.m * r.k * r.n * r.count for r in measured.matmuls)
    achieved = flops / sum(r.seconds * r.count for r in measured.matmuls)
    assert eff.matrix == pytest.approx(achieved / base.bf16_flops)
    assert eff.memory == pytest.approx(measured.hbm_bytes_per_s / base.hbm_bytes_per_s)
    # the floor is fitted so that the profile predicts the measured step, unless the
    # roofline alone already takes longer (a floor is never negative)
    if eff.kernel_floor_s > 0:
        assert measured.predicted_s == pytest.approx(measured.step_s, rel=1e-9)
    else:
        assert measured.predicted_s >= measured.step_s
    assert measured.profile.calibration["step"]["measured_s"] == measured.step_s


def test_plan_reads_the_calibrated_profile(measured, tmp_path):
    path = tmp_path / "gpu.json"
    write_profile(path, measured.profile)
    args = ["plan", "--model", "sample_models.models:llama", "--seq-len", "32",
            "--world-size", "1,2", "--micro-batch", "2", "--checkpointing", "none",
            "--target", "cpu"]  # fmt: skip
    result = runner.invoke(app, [*args, "--gpu-profile", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["timing"]["gpu"] == "H100-SXM-calibrated"
    eff = measured.profile.efficiency
    assert doc["timing"]["efficiency"]["matrix"] == eff.matrix
    assert doc["timing"]["efficiency"]["kernel_floor_s"] == pytest.approx(eff.kernel_floor_s)
    one = next(r for r in doc["rows"] if r["world_size"] == 1)
    # the plan's cell is the calibrated step: the same step the profile was fitted to
    assert one["time"]["step_s"] == pytest.approx(measured.predicted_s, rel=1e-6)


def test_training_shapes_of_the_linear_layers():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(8, 16))
    assert training_matmuls(model, 10) == Counter(
        {(10, 8, 16): 2, (10, 16, 8): 2, (16, 10, 8): 2, (10, 16, 4): 1, (10, 4, 16): 1,
         (4, 10, 16): 1}
    )  # fmt: skip


def test_the_measurements_take_a_device_by_name():
    assert MatmulRate(2, 3, 4, 1, 0.5).flops_per_s == 2 * 2 * 3 * 4 / 0.5
    assert time_matmul("cpu", 64, 32, 16, torch.float32, repeat=2) > 0
    assert hbm_bandwidth("cpu", 1 << 20, repeat=2) > 0


@pytest.mark.parametrize(
    ("device", "row"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_a_device_name_finds_its_row(device, row):
    assert table_gpu(device).name == row


def test_an_unknown_device_asks_for_gpu():
    with pytest.raises(YafsdpError, match="'Tesla V100' is not in the GPU table; give --gpu"):
        table_gpu("Tesla V100")


@pytest.mark.parametrize(
    ("efficiency", "message"),
    [
        ({"matrix": 1.5}, "efficiency matrix must be in"),
        ({"speed": 1}, "unknown efficiency 'speed'"),
        ({"memory": "fast"}, "efficiency 'memory' must be a number"),
        ([], "'efficiency' must be an object"),
    ],
)
def test_bad_efficiencies_are_one_line(efficiency, message):
    doc = {**profile_to_dict(profile_from_dict(_h100())), "efficiency": efficiency}
    with pytest.raises(YafsdpError, match=message):
        profile_from_dict(doc, where="gpu.json")


def _h100() -> dict:
    g = gpu_spec("h100-sxm")
    return {"name": g.name, "memory_bytes": g.memory_bytes, "bf16_tflops": 989.4,
            "fp32_tflops": 66.9, "hbm_gbps": 3350, "link_gbps": 450,
            "gpus_per_node": 8}  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: calibrate would run")
def test_calibrate_without_a_gpu_is_one_line_exit_2(tmp_path):
    out = tmp_path / "gpu.json"
    result = runner.invoke(
        app, ["calibrate", "--model", "sample_models.models:llama", "-o", str(out)]
    )
    assert result.exit_code == 2
    assert "torch sees none here" in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_gpu_table_loader_reads_a_calibrated_profile_too(measured, tmp_path):
    path = tmp_path / "gpu.json"
    write_profile(path, measured.profile)
    assert resolve_gpu(str(path)) == measured.profile.gpu
