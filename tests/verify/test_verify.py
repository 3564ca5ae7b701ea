"""`yafsdp verify` in one process: sample models, broken conversions, tolerances, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import options
from torch import nn
from typer.testing import CliRunner

import yafsdp_cli.engine.flat as flat_engine
import yafsdp_cli.verify.single as verify_single
from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.engine.module_spec import spec_from_module
from yafsdp_cli.engine.plan import plan
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify.entry import verify_model
from yafsdp_cli.verify.harness import (
    Tolerance,
    VerifyOptions,
    diff_tensors,
    held_bytes,
    resolve_tolerances,
)

runner = CliRunner()
EXACT = {"float32": Tolerance("float32", 0.0, 0.0), "bfloat16": Tolerance("bfloat16", 0, 0)}


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def test_every_sample_model_matches_exactly(sample_name):
    report = verify_model(loaded(sample_name), VerifyOptions())
    assert report.ok, report.first_failure
    assert report.failures == 0 and report.first_failure is None
    # 3 steps x (2 outputs + every gradient, parameter and buffer name)
    names = len(list(loaded(sample_name).module.named_parameters(remove_duplicate=False)))
    assert report.compared >= 3 * (2 + 2 * names)
    assert all(d.max_abs == 0 for d in report.worst)
    (memory,) = report.memory
    assert memory.ok and abs(memory.diff_percent) < 0.01
    assert memory.measured.params == memory.modeled.params  # exact storages, no rounding


def test_tied_names_are_compared_one_by_one():
    report = verify_model(loaded("gpt"), options(VerifyOptions, steps=1, top=1000))
    names = {(d.kind, d.name) for d in report.worst}
    assert ("gradient", "lm_head.weight") in names
    assert ("gradient", "transformer.wte.weight") in names
    assert ("parameter", "lm_head.weight") in names


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "none"])
def test_other_optimizers_and_a_partial_conversion(optimizer):
    report = verify_model(
        loaded("llama"), options(VerifyOptions, optimizer=optimizer, filters=("linear",))
    )
    assert report.ok, report.first_failure
    assert report.kept == 6  # embedding and norms stay ordinary parameters
    assert report.converted == 15  # 7 Linear weights per layer x 2 + lm_head


def _split_tie(monkeypatch):
    """Convert with the tie split into two parameters (the seed's defect)."""
    real = flat_engine.convert_module

    def convert(module, _layout):
        module.lm_head.weight = nn.Parameter(module.transformer["wte"].weight.detach().clone())
        return real(module, plan(spec_from_module(module)))

    monkeypatch.setattr(verify_single, "convert_module", convert)


def test_a_split_tie_fails_and_names_the_tensor(monkeypatch):
    _split_tie(monkeypatch)
    report = verify_model(loaded("gpt"), options(VerifyOptions, steps=1))
    assert not report.ok
    assert report.first_failure.kind == "gradient"
    assert report.first_failure.name in ("lm_head.weight", "transformer.wte.weight")
    failing = {d.name for d in report.worst if not d.ok}
    assert {"lm_head.weight", "transformer.wte.weight"} <= failing


def test_a_corrupted_gradient_fails_through_the_cli_with_exit_1(monkeypatch):
    real = flat_engine.convert_module

    def convert(module, layout):
        flat = real(module, layout)
        buf = flat.buffers[-1]
        inner, target = buf.accumulate, len(buf.layout.entries) - 1

        def accumulate(index, grad):
            inner(index, grad * 1.001 if index == target else grad)

        buf.accumulate = accumulate
        return flat

    monkeypatch.setattr(verify_single, "convert_module", convert)
    result = runner.invoke(app, ["verify", "--model", "sample_models.models:mlp"])
    assert result.exit_code == 1, result.output
    assert "MISMATCH" in result.output and "net.4.bias" in result.output


def test_cli_ok_and_json(tmp_path):
    result = runner.invoke(
        app, ["verify", "sample_models/llama.safetensors", "--model", "sample_models.models:llama"]
    )
    assert result.exit_code == 0, result.output
    assert "OK: converted model matches" in result.output
    result = runner.invoke(
        app, ["verify", "--model", "sample_models.models:cnn", "--json", "--steps", "2"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "yafsdp.verify/1"
    rep = doc["report"]
    assert rep["ok"] is True and rep["steps"] == 2 and rep["world_size"] == 1
    kinds = {d["kind"] for d in rep["worst"]}
    assert kinds <= {"output", "gradient", "parameter", "buffer"}
    assert rep["memory"][0]["ok"] is True


def test_json_has_no_infinity(monkeypatch):
    _split_tie(monkeypatch)
    result = runner.invoke(
        app, ["verify", "--model", "sample_models.models:gpt", "--json", "--steps", "1"]
    )
    assert result.exit_code == 1
    doc = json.loads(result.stdout)  # strict JSON: no Infinity token
    assert doc["report"]["failures"] > 0


def test_markdown():
    result = runner.invoke(
        app,
        ["verify", "--model", "sample_models.models:mlp", "--format", "markdown", "--steps", "1"],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("**OK") and "| kind |" in result.stdout  # header on stderr


def test_input_shape_is_used():
    report = verify_model(
        load_source(None, model="sample_models.models:gpt"),
        options(VerifyOptions, steps=1, input_shape=(3, 5)),
    )
    assert report.ok


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "sample_models/gpt.safetensors"], "needs its architecture"),
        (["verify", "--model", "sample_models.models:gpt", "--optimizer", "lion"], "lion"),
        (["verify", "--model", "sample_models.models:gpt", "--filter", "conv"], "conv"),
        (["verify", "--model", "sample_models.models:gpt", "--atol", "-1"], "--atol"),
        (["verify", "--model", "sample_models.models:gpt", "--input-shape", "0,3"], "0,3"),
        (["verify", "--model", "sample_models.models:gpt", "--format", "yaml"], "yaml"),
        (["verify", "--model", "sample_models.models:cnn", "--input-shape", "2,5"], "forward"),
        (["verify", "sample_models/gpt_module.pt"], "--trust-pickle"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_pickled_module_with_trust():
    result = runner.invoke(
        app, ["verify", "sample_models/gpt_module.pt", "--trust-pickle", "--steps", "1"]
    )
    assert result.exit_code == 0, result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_so():
    with pytest.raises(YafsdpError, match="no CUDA device"):
        verify_model(loaded("mlp"), options(VerifyOptions, device="cuda"))


# -- the comparison itself ------------------------------------------------------------


def test_exact_comparison_sees_one_ulp():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.nextafter(a, torch.tensor(10.0))
    d = diff_tensors("gradient", "w", 0, b, a, EXACT)
    assert not d.ok and 0 < d.max_abs < 1e-6
    loose = {"float32": Tolerance("float32", 1e-6, 0.0)}
    assert diff_tensors("gradient", "w", 0, b, a, loose).ok


def test_nans_in_the_same_places_are_equal_elsewhere_not():
    a = torch.tensor([1.0, math.nan])
    assert diff_tensors("output", "y", 0, a.clone(), a, EXACT).ok
    d = diff_tensors("output", "y", 0, torch.tensor([math.nan, math.nan]), a, EXACT)
    assert not d.ok and math.isinf(d.max_abs)


def test_none_and_shape_mismatches():
    zeros, ones = torch.zeros(3), torch.ones(3)
    ok = diff_tensors("gradient", "w", 0, zeros, None, EXACT)
    assert ok.ok and ok.problem == "no gradient; zeros"
    assert not diff_tensors("gradient", "w", 0, ones, None, EXACT).ok
    assert diff_tensors("gradient", "w", 0, None, ones, EXACT).problem == "None in converted"
    bad = diff_tensors("parameter", "w", 0, torch.ones(4), ones, EXACT)
    assert not bad.ok and "(4,)" in bad.problem
    d = diff_tensors("parameter", "w", 0, torch.ones(3, dtype=torch.bfloat16), ones, EXACT)
    assert not d.ok and "bfloat16" in d.problem


def test_default_tolerances():
    cpu = resolve_tolerances("cpu", None, None)
    assert all(t.atol == 0 and t.rtol == 0 for t in cpu.values())
    cuda = resolve_tolerances("cuda", None, None)
    assert cuda["bfloat16"].rtol == 1.6e-2 and cuda["float32"].rtol == 1.3e-6
    given = resolve_tolerances("cpu", 1e-3, None)
    assert given["float16"].atol == 1e-3 and given["float16"].rtol == 0


def test_held_bytes_counts_each_storage_once():
    w = torch.zeros(10)
    view = w[2:5]
    state = torch.zeros(4, dtype=torch.float64)
    held = held_bytes(([w, view], [None, w], [state], []), round_bytes=1)
    assert (held.params, held.grads, held.optimizer, held.buffers) == (40, 0, 32, 0)
    assert held_bytes(([w], [], [state], []), round_bytes=512).total == 1024


def test_options_are_checked():
    with pytest.raises(YafsdpError, match="--steps must be at least 1"):
        options(VerifyOptions, steps=0)
    with pytest.raises(YafsdpError, match="--device 'tpu'"):
        options(VerifyOptions, device="tpu")


FROZEN_AND_UNUSED = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(3))
        # both smaller than a block: they share the root unit's buffer (a module that
        # outweighs a block would be a unit of its own, units.split_units)
        self.unused = nn.Linear(24, 8)
        self.head = nn.Linear(24, 20)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def build():
    return M()
"""


def test_frozen_and_unused_parameters(tmp_path):
    """A frozen embedding is fine; an unused Linear gets zeros in its flat buffer, so
    AdamW decays it where torch skips the original: reported, with what to do."""
    factory = tmp_path / "frozen_unused.py"
    factory.write_text(FROZEN_AND_UNUSED)
    model = f"{factory}:build"
    result = runner.invoke(app, ["verify", "--model", model, "--json"])
    assert result.exit_code == 1
    rep = json.loads(result.stdout)["report"]
    assert rep["first_failure"]["name"].startswith("unused.")
    assert rep["first_failure"]["kind"] == "parameter"
    assert any("--exclude them" in n for n in rep["notes"])
    result = runner.invoke(
        app, ["verify", "--model", model, "--exclude", "name:unused.*", "--json"]
    )
    assert result.exit_code == 0, result.output
    rep = json.loads(result.stdout)["report"]
    # the kept unused Linear holds no gradient and no state, and the model is told so
    assert rep["kept"] == 2 and rep["memory"][0]["ok"]
