"""``plan --scheme``: each scheme's formula, the side-by-side output, its errors.

The fsdp2 and ddp rows against the real engines: ``test_plan_scheme_truth.py``.
The zero rows against DeepSpeed's real engine, where it is installed:
``test_plan_zero_truth.py``; here, without it, against its documented settings and
the allocations its source makes, phase by phase (``memory.step_schemes``' notes).
"""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from scheme_cases import spec
from typer.testing import CliRunner

from yafsdp_cli import plan
from yafsdp_cli.cli import app
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.memory import MemoryConfig, estimate_memory
from yafsdp_cli.memory.config import tensors_of_layout, whole_bytes
from yafsdp_cli.memory.step_schemes import (
    DDP_BUCKET_CAP,
    DDP_FIRST_BUCKET,
    SchemeSettings,
    StepAt,
    ZeroConfig,
    ddp_buckets,
    scheme_memory,
)
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.schemes import NAMES as SCHEMES
from yafsdp_cli.schemes import by_name
from yafsdp_cli.schemes import check_names as check_schemes

runner = CliRunner()
SCHEMA = json.loads(resources.files("yafsdp_cli").joinpath("schemas/plan.schema.json").read_text())
MIB = 2**20


def _memory(scheme: str, ws: int, settings=None, cfg=None):
    layout = plan(spec(), LayoutOptions(world_size=ws, units=("layers.*",)))
    return scheme_memory(by_name(scheme), layout, cfg or MemoryConfig(round_bytes=1), settings)


def test_scheme_names_parse_in_one_order_and_unknown_ones_are_errors():
    assert check_schemes("all") == SCHEMES
    assert check_schemes("zero3, flat") == ("flat", "zero3")
    assert check_schemes(("ddp", "fsdp2")) == ("flat", "fsdp2", "ddp")
    with pytest.raises(YafsdpError, match=r"--scheme 'zero4': unknown scheme zero4; give"):
        check_schemes("zero4")
    with pytest.raises(YafsdpError, match="unknown scheme"):
        check_schemes(",")


def test_nothing_communicates_at_world_size_1():
    for scheme in SCHEMES:
        m = _memory(scheme, 1)
        assert (m.gather, m.reduce) == (0, 0), scheme
        assert m.persistent == _memory("ddp", 1).persistent, scheme


def test_ddp_buckets_are_a_second_copy_of_every_gradient():
    layout = plan(spec(), LayoutOptions(world_size=2, units=("layers.*",)))
    cfg = MemoryConfig(round_bytes=1)
    converted, kept, _ = tensors_of_layout(layout)
    grads = whole_bytes(converted + kept, cfg)["grads"]
    ddp = _memory("ddp", 2)
    assert ddp.reduce == grads and ddp.total == estimate_memory(layout, cfg).baseline.total + grads
    assert _memory("ddp", 2, SchemeSettings(ddp_bucket_view=True)).reduce == 0
    # per bucket, one rounded allocation: 1 MiB first, then 25 MiB
    from yafsdp_cli.memory.config import TensorSize

    tensors = [TensorSize(MIB // 2, "float32", True) for _ in range(30)]  # 2 MiB each
    rounded = MemoryConfig(round_bytes=3 * MIB)
    buckets = ddp_buckets(tensors, rounded)
    assert buckets % (3 * MIB) == 0
    sizes = [2 * MIB, *([26 * MIB] * 2), 6 * MIB]  # 2 >= 1 MiB, then 13 tensors each
    assert sum(sizes) == 60 * MIB and DDP_FIRST_BUCKET < 2 * MIB < DDP_BUCKET_CAP
    assert buckets == sum(-(-s // (3 * MIB)) * 3 * MIB for s in sizes)


def test_zero_stages_shard_what_deepspeed_says_and_keep_its_buckets():
    zero = ZeroConfig()
    ws = 4
    z1, z2, z3 = (_memory(s, ws) for s in ("zero1", "zero2", "zero3"))
    ddp = _memory("ddp", ws)
    # the contiguous-gradient bucket: reduce_bucket_size elements of bfloat16, whole
    for m in (z1, z2, z3):
        assert m.reduce == zero.reduce_bucket_size * 2
    assert z1.params == z2.params == ddp.params  # parameters whole in stages 1 and 2
    assert z1.grads == ddp.grads and z2.grads < ddp.grads / ws * 1.01
    assert z1.optimizer == z2.optimizer == z3.optimizer < ddp.optimizer / ws * 1.01
    # stage 3: norms (<= 1e5 elements) stay whole; the large weights are partitioned
    norms = 3 * 512 * 2
    large = (4 * 512 * 512 + 6 * 512 * 512) * 2
    assert z3.params == norms + large // ws
    # gathered: a model below max_reuse_distance stays gathered whole into backward
    every = 4 * 512 * 512 + 3 * (2 * 512 * 512 + 512)
    assert z3.gather == every * 2 < zero.max_reuse_distance
    # above it: the largest unit and as much of the next as the prefetch bucket allows,
    # or the last max_reuse_distance elements, whichever is more
    layout = plan(spec(), LayoutOptions(world_size=ws, units=("layers.*",)))
    cfg = MemoryConfig(round_bytes=1)
    for distance, live in ((1000, 2 * 4 * 512 * 512), (2_500_000, 2_500_000)):
        small = ZeroConfig(max_reuse_distance=distance, prefetch_bucket_size=10**8)
        got = scheme_memory(by_name("zero3"), layout, cfg, SchemeSettings(zero=small)).gather
        assert got == live * 2, distance


def test_zero_settings_are_deepspeeds_defaults():
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    ds = config.DeepSpeedZeroConfig()
    ours = ZeroConfig()
    assert ours.reduce_bucket_size == ds.reduce_bucket_size
    assert ours.allgather_bucket_size == ds.allgather_bucket_size
    assert ours.prefetch_bucket_size == ds.prefetch_bucket_size
    assert ours.param_persistence_threshold == ds.param_persistence_threshold
    assert ours.max_live_parameters == ds.max_live_parameters
    assert ours.max_reuse_distance == ds.max_reuse_distance


def test_fsdp2_kept_gathered_holds_every_unit():
    resharded = _memory("fsdp2", 4)
    kept = _memory("fsdp2", 4, SchemeSettings(reshard_after_forward=False))
    every = (4 * 512 * 512 + 3 * (2 * 512 * 512 + 512)) * 2  # bfloat16, even splits
    assert kept.gather == every > resharded.gather
    assert kept.persistent == resharded.persistent
    # master weights: float32 shards, bfloat16 gathered (MixedPrecisionPolicy)
    assert resharded.master == 0 and resharded.optimizer > 0


def _at(phase: str, scheme: str, ws: int, step: StepAt, settings=None) -> int:
    m = _memory(scheme, ws, settings)
    return by_name(scheme).phase_peak(phase, m, step, ws, settings or SchemeSettings())


def test_zero_stages_hold_per_phase_what_deepspeed_allocates_then():
    ws = 4
    z1, z2 = _memory("zero1", ws), _memory("zero2", ws)
    base = z2.params + z2.optimizer + z2.master + z2.buffers  # whole bf16, partitioned rest
    before = StepAt(activations=100, temporaries=-10, unheld=30, grads=0)  # own: 120
    landed = StepAt(activations=100, temporaries=-10, unheld=30, grads=5000)
    # forward: no gradient and no bucket (made at the first gradient, freed after backward)
    for s in ("zero1", "zero2"):
        assert _at("forward", s, ws, landed) == base + 120
        assert _at("backward", s, ws, before) == base + 120
    # backward once gradients land: stage 2 copies each into the bucket and its partition
    # buffer and frees it; stage 1 reduces after backward, so they land whole first
    assert _at("backward", "zero2", ws, landed) == base + z2.reduce + z2.grads + 120
    assert _at("backward", "zero1", ws, landed) == base + 5000 + z1.reduce + 120
    # optimizer: the step's gradients and temporaries, of a 1/ws partition
    assert _at("optimizer", "zero2", ws, landed) == base + 100 + (20 + 5000) // ws
    z3 = _memory("zero3", ws)
    assert _at("forward", "zero3", ws, landed) == z3.total + 120
    assert _at("optimizer", "zero3", ws, landed) == z3.total - z3.gather + 120


def test_fsdp2_kept_gathered_peaks_with_every_unit_and_no_gradient():
    ws, step = 4, StepAt(activations=100, temporaries=-10, unheld=30, grads=0)
    kept = SchemeSettings(reshard_after_forward=False)
    m = _memory("fsdp2", ws, kept)
    assert _at("forward", "fsdp2", ws, step, kept) == m.total - m.grads - m.reduce + 120
    assert _at("backward", "fsdp2", ws, step, kept) == m.total - m.grads + 120
    assert _at("optimizer", "fsdp2", ws, step, kept) == m.total - m.gather - m.reduce + 120
    # resharding, flat and ddp: their holdings where the reference step's model bytes were
    for s in ("fsdp2", "flat", "ddp"):
        assert _at("forward", s, ws, step) == _memory(s, ws).total + 90


def _plan(*extra: str):
    sizes = () if "--world-size" in extra else ("--world-size", "1,2,4")
    return runner.invoke(
        app,
        [
            "plan", "--model", "sample_models.models:gpt", "--gpu-memory", "2MiB",
            "--reserve", "0", *sizes, "--micro-batch", "1,2",
            "--seq-len", "16", "--checkpointing", "none", *extra,
        ],
        env={"COLUMNS": "400"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def all_schemes():
    result = _plan("--scheme", "all", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_scheme_all_json_follows_its_schema(all_schemes):
    doc = all_schemes
    jsonschema.validate(doc, SCHEMA)
    assert [s["scheme"] for s in doc["schemes"]] == list(SCHEMES)
    grid = {(r["world_size"], r["micro_batch"]): r["peak_bytes"] for r in doc["rows"]}
    by = {s["scheme"]: s for s in doc["schemes"]}
    assert {(r["world_size"], r["micro_batch"]): r["peak_bytes"] for r in by["flat"]["rows"]} == {
        k: v for k, v in grid.items()
    }
    for s in doc["schemes"]:
        assert len(s["rows"]) == 3 * 2
        for r in s["rows"]:
            parts = r["persistent_bytes"] + r["gather_bytes"] + r["reduce_bytes"]
            assert r["peak_bytes"] == parts + r["activations"] + r["temporaries"]
            assert r["fits"] == (r["needed_bytes"] <= doc["gpu_memory_bytes"])
        if s["best"] is not None:
            assert s["best"]["fits"]
        if s["flat_saves_bytes"] is not None:
            ws, mb, ck = s["compared_at"]
            flat = next(
                r for r in by["flat"]["rows"] if (r["world_size"], r["micro_batch"]) == (ws, mb)
            )
            mine = next(r for r in s["rows"] if (r["world_size"], r["micro_batch"]) == (ws, mb))
            assert s["flat_saves_bytes"] == mine["peak_bytes"] - flat["peak_bytes"]
    # whole parameters everywhere: DDP never needs fewer GPUs than the flat scheme
    for flat, ddp in zip(by["flat"]["smallest"], by["ddp"]["smallest"]):
        if ddp["world_size"] is not None:
            assert flat["world_size"] is not None and flat["world_size"] <= ddp["world_size"]


def test_each_row_says_whether_its_engine_ran_and_gives_every_ranks_peak(all_schemes):
    """fsdp2 and ddp run their engines (every rank: runs of ranks cover them all, the
    row's peak one of theirs); the zero stages are modelled and say so, rows and
    scheme alike; the flat rows are the plan's own (every rank alike)."""
    for s in all_schemes["schemes"]:
        modelled = s["scheme"] in ("zero1", "zero2", "zero3")
        assert s["modelled"] is modelled and ("modelled, not run" in s["method"]) is modelled
        for r in s["rows"]:
            assert r["modelled"] is modelled
            if modelled:
                assert r["ranks"] == [] and r["rank_spread_bytes"] == 0
                continue
            firsts = [g["first"] for g in r["ranks"]]
            lasts = [g["last"] for g in r["ranks"]]
            assert firsts[0] == 0 and lasts[-1] == r["world_size"] - 1
            assert firsts[1:] == [x + 1 for x in lasts[:-1]]  # runs, in rank order
            peaks = [g["peak_bytes"] for g in r["ranks"]]
            assert r["peak_bytes"] in peaks
            assert r["rank_spread_bytes"] == max(peaks) - min(peaks)
    by = {s["scheme"]: s for s in all_schemes["schemes"]}
    assert "fully_shard run in the fake step" in by["fsdp2"]["method"]
    assert "DistributedDataParallel run in the fake step" in by["ddp"]["method"]
    # one rank on its own: no engine wraps it, fsdp2 and ddp run the same step
    one = [
        [(r["micro_batch"], r["peak_bytes"]) for r in by[name]["rows"] if r["world_size"] == 1]
        for name in ("fsdp2", "ddp")
    ]
    assert one[0] == one[1]


def test_ranks_that_peak_apart_are_listed_with_explain():
    """At 3 ranks the sample GPT's 64- and 256-row weights split 22, 22, 20 and 86, 86,
    84: FSDP2's last rank peaks lower. The terminal points to it; --explain and the
    markdown list each rank's peak."""
    args = ["--world-size", "3", "--scheme", "fsdp2"]
    out = " ".join(_plan(*args).output.split())
    assert "ranks differ in 2 cells: --explain" in out  # micro-batches 1 and 2
    explained = " ".join(_plan(*args, "--explain").output.split())
    assert "fsdp2, world size 3, micro-batch 1, none: ranks peak apart by" in explained
    assert "ranks 0-1 " in explained and "rank 2 " in explained
    markdown = _plan(*args, "--format", "markdown").stdout
    assert "ranks peak apart by" in markdown and "| rows | flat steps | engine run |" in markdown


def test_schemes_fit_as_the_plan_does_with_the_itemised_outside_parts():
    """Without --reserve a rank holds the itemised parts beside the allocator; every
    scheme's cell fits on reserved + those, and the flat column is the plan's grid."""
    result = runner.invoke(
        app,
        [
            "plan", "--model", "sample_models.models:gpt", "--gpu-memory", "80GiB",
            "--world-size", "1,2", "--micro-batch", "1,2", "--seq-len", "16",
            "--checkpointing", "none", "--scheme", "flat,fsdp2,ddp", "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    plan_rows = {(r["world_size"], r["micro_batch"]): r for r in doc["rows"]}
    for s in doc["schemes"]:
        for r in s["rows"]:
            outside = sum(p["bytes"] for p in plan_rows[r["world_size"], 1]["outside"])
            assert r["needed_bytes"] == r["reserved_bytes"] + outside > 0
            assert r["reserved_bytes"] >= r["peak_bytes"]
            if s["scheme"] == "flat":
                b = s["best"]
                assert (b["world_size"], b["micro_batch"]) == (
                    doc["best"]["world_size"],
                    doc["best"]["micro_batch"],
                )  # the flat column's best is the plan's
                own = plan_rows[r["world_size"], r["micro_batch"]]
                assert (r["reserved_bytes"], r["needed_bytes"]) == (
                    own["reserved_bytes"],
                    own["needed_bytes"],
                )


def test_plan_without_scheme_is_the_flat_plan_alone():
    result = _plan("--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["schemes"] == [] and doc["options"]["schemes"] == ["flat"]


def test_plan_scheme_markdown_table_and_html(tmp_path):
    result = _plan("--scheme", "flat,fsdp2,ddp", "--format", "markdown")
    assert result.exit_code == 0, result.output
    assert "| | flat | fsdp2 | ddp |" in result.stdout.replace("|  |", "| |")
    assert "fewest GPUs, micro-batch 2" in result.stdout
    assert "flat saves at the peak" in result.stdout
    page = tmp_path / "plan.html"
    result = _plan("--scheme", "ddp", "--html", str(page))
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert "Schemes side by side" in text and '<th class="r">ddp</th>' in text
    assert '<th class="r">flat</th>' in text  # the flat column is always there
    assert "Schemes side by side" in result.stdout


def test_plan_unknown_scheme_is_one_line_exit_2():
    result = _plan("--scheme", "flat,megatron")
    assert result.exit_code == 2, result.output
    assert "unknown scheme megatron" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("gpu", [None, "h100-sxm"])
def test_the_schemes_table_says_what_its_best_rows_rank_by(gpu):
    """The schemes table's best configuration is the most tokens per rank; where the
    answer above ranks by speed on a named GPU, the caption says the two differ."""
    args = ["plan", "--model", "sample_models.models:gpt", "--seq-len", "64", "--world-size",
            "1,2", "--micro-batch", "1,2", "--scheme", "all", "--reserve", "0"]  # fmt: skip
    args += ["--gpu", gpu] if gpu else ["--gpu-memory", "80GiB"]
    result = runner.invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "best configuration: the most tokens per rank that fits so, then no" in text
    assert ("the answer above ranks by throughput on H100-SXM instead" in text) == bool(gpu)
