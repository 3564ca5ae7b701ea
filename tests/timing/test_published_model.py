"""The published-efficiency model: lookups by GPU and shape, the attention kernel's
rate, and the published rows the benchmark plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yafsdp_cli.timing import gpu_spec
from yafsdp_cli.timing.op_costs import OpCost
from yafsdp_cli.timing.roofline import Efficiency, efficiency_for, matrix_efficiency

ROWS = Path(__file__).resolve().parents[2] / "benchmarks" / "published.json"


def op(name: str, dims: tuple[int, ...]) -> OpCost:
    return OpCost(name, "forward", "bfloat16", 1, 1, 0, 0, False, dims)


def test_each_gpu_has_its_own_matrix_efficiency():
    a100, h100 = efficiency_for(gpu_spec("a100-80gb")), efficiency_for(gpu_spec("h100-sxm"))
    assert a100.matrix == pytest.approx(271.2 / 312, abs=1e-3)  # MAMF table
    assert h100.matrix == pytest.approx(794.5 / 989.4, abs=2e-3)
    assert efficiency_for(gpu_spec("l40s")) == Efficiency()  # no published figure


def test_a_narrow_product_runs_slower_than_a_wide_one():
    eff = efficiency_for(gpu_spec("h100-sxm"))
    wide = matrix_efficiency(op("aten.mm.default", (8192, 4096, 4096)), eff)
    narrow = matrix_efficiency(op("aten.mm.default", (8192, 768, 768)), eff)
    assert wide == pytest.approx(eff.matrix * 4096 / (4096 + 256))
    assert narrow == pytest.approx(eff.matrix * 768 / (768 + 256))
    assert narrow < wide < eff.matrix
    assert matrix_efficiency(op("aten.mm.default", ()), eff) == eff.matrix


def test_attention_has_its_own_rate_by_sequence_and_head_dim():
    eff = efficiency_for(gpu_spec("a100-80gb"))
    fwd = "aten._scaled_dot_product_flash_attention.default"
    bwd = "aten._scaled_dot_product_flash_attention_backward.default"
    long = matrix_efficiency(op(fwd, (16384, 128, 1)), eff)
    assert long == pytest.approx(eff.attention_forward * 16384 / (16384 + 512))
    assert matrix_efficiency(op(bwd, (16384, 128, 1)), eff) < long
    assert matrix_efficiency(op(fwd, (2048, 128, 1)), eff) < long
    head64 = matrix_efficiency(op(fwd, (16384, 64, 1)), eff)
    assert head64 / long == pytest.approx((64 / 72) / (128 / 136))


def test_every_published_row_has_a_source_and_what_the_benchmark_needs():
    rows = json.loads(ROWS.read_text())["rows"]
    assert len(rows) >= 20
    assert len({r["source"]["repository"] for r in rows}) >= 3
    assert {r["gpu"] for r in rows} >= {"A100-80GB", "H100-SXM"}
    assert any(r["world_size"] > 8 for r in rows) and any(r["world_size"] <= 8 for r in rows)
    assert max(r["seq_len"] for r in rows) >= 32768 and min(r["seq_len"] for r in rows) <= 2048
    for r in rows:
        src = r["source"]
        assert src["repository"] and src["path"] and len(src["commit"]) == 40, r["id"]
        gpu_spec(r["gpu"])
        assert r["grad_dtype"] in ("fp32", "bf16")
        assert r["world_size"] >= 1 and r["micro_batch"] >= 1 and r["seq_len"] >= 1
        assert r["published_tokens_per_s_per_gpu"] > 0
        assert r["model"]["model_type"] in ("gpt2", "llama") and r["notes"]
