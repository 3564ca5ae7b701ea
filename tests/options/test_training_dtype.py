"""One dtype rule: a source that stores no dtype is trained in the same dtype by
inspect, plan and profile, each says so first, and --param-dtype overrides it."""

from __future__ import annotations

import json

import pytest
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.options import DEFAULT_TRAINING_DTYPE
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

pytest.importorskip("transformers")
from hf_models import tiny_config  # noqa: E402

pytestmark = pytest.mark.hf
runner = CliRunner()
PARTS = ("params", "grads", "optimizer", "master", "buffers")


@pytest.fixture(scope="module")
def no_dtype(tmp_path_factory):
    """An HF config folder without dtype, as transformers 5 saves a config built in code."""
    folder = tmp_path_factory.mktemp("no-dtype")
    tiny_config("llama").save_pretrained(folder)
    doc = json.loads((folder / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        doc.pop(key, None)
    (folder / "config.json").write_text(json.dumps(doc))
    return folder


def _json(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_inspect_and_plan_train_a_dtypeless_source_alike(no_dtype):
    assert not load_source(no_dtype).spec.dtype_stored
    inspected = _json(["inspect", str(no_dtype), "--json"])
    grid = ["--world-size", "1", "--micro-batch", "1", "--checkpointing", "none"]
    planned = _json(
        ["plan", str(no_dtype), "--gpu-memory", "1GiB", "--reserve", "0", "--seq-len", "16"]
        + [*grid, "--json"]
    )
    assert inspected["inputs"]["param_dtype"] == planned["param_dtype"] == DEFAULT_TRAINING_DTYPE
    assert inspected["assumptions"][0].startswith(f"parameters in {DEFAULT_TRAINING_DTYPE}:")
    flat = next(s for s in inspected["memory"]["schemes"] if s["scheme"] == "yafsdp")
    row = planned["rows"][0]
    assert {p: flat[p] for p in PARTS} == {p: row["breakdown"][p] for p in PARTS}
    assert flat["master"] > 0  # 16-bit parameters get float32 masters


def test_param_dtype_overrides_the_rule(no_dtype):
    default = _json(["inspect", str(no_dtype), "--json"])
    fp32 = _json(["inspect", str(no_dtype), "--param-dtype", "fp32", "--json"])
    assert fp32["inputs"]["param_dtype"] == "float32"
    assert fp32["assumptions"][0] == "parameters in float32 (--param-dtype)"
    assert fp32["params"]["total_numel"] == default["params"]["total_numel"]
    flat16 = next(s for s in default["memory"]["schemes"] if s["scheme"] == "yafsdp")
    flat32 = next(s for s in fp32["memory"]["schemes"] if s["scheme"] == "yafsdp")
    assert flat32["params"] > flat16["params"] and flat32["master"] == 0


def test_profile_follows_the_rule_and_says_so(no_dtype):
    loaded = load_source(no_dtype)
    small = dict(fake=True, seq_len=8, batch=1, target="cpu")
    report = profile_model(loaded, options(ProfileOptions, **small))
    assert report.training_dtype.startswith(f"parameters in {DEFAULT_TRAINING_DTYPE}:")
    fp32 = profile_model(loaded, options(ProfileOptions, **small, param_dtype="fp32"))
    assert fp32.training_dtype == "parameters in float32 (--param-dtype)"
    assert 2 * report.original.peak.parameters == fp32.original.peak.parameters


def test_a_source_with_a_dtype_keeps_it(tmp_path):
    cfg = tiny_config("llama")
    cfg.dtype = "float16"
    cfg.save_pretrained(tmp_path)
    loaded = load_source(tmp_path)
    assert loaded.spec.dtype_stored
    doc = _json(["inspect", str(tmp_path), "--json"])
    assert doc["inputs"]["param_dtype"] is None
    assert doc["assumptions"][0] == "parameters in their stored dtype (float16)"
