"""The options model: pieces validate once; commands' options are made of them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from yafsdp_cli.errors import FilterError, YafsdpError
from yafsdp_cli.inspection.inspect_options import InspectOptions
from yafsdp_cli.memory.headroom import fit, needed_bytes, process_sum
from yafsdp_cli.options import LayoutOptions, MemoryOptions, StepOptions
from yafsdp_cli.planning import PlanOptions
from yafsdp_cli.planning.plan_options import PLAN_MEMORY, PLAN_STEP, SAVED
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.verify import VerifyOptions


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LayoutOptions(world_size=0), "--world-size must be at least 1, got 0"),
        (lambda: StepOptions(batch=0), "--batch must be at least 1, got 0"),
        (lambda: StepOptions(seq_len=0), "--seq-len must be at least 1, got 0"),
        (lambda: StepOptions(device="tpu"), "--device 'tpu' is not cpu or cuda"),
        (lambda: StepOptions(target="tpu"), "--target 'tpu' is not cpu or cuda"),
        (lambda: StepOptions(optimizer="lion"), "--optimizer 'lion' is not one of"),
        (lambda: StepOptions(optimizer_impl="x"), "--optimizer-impl 'x' is not one of"),
        (lambda: StepOptions(checkpointing="x"), "--checkpointing 'x' is not one of"),
        (lambda: StepOptions(param_dtype="int8"), "--param-dtype 'int8' is not a floating"),
        (lambda: StepOptions(grad_dtype="int32"), "--grad-dtype 'int32' is not a floating"),
        (lambda: MemoryOptions(gpu_memory=0), "--gpu-memory must be positive"),
        (lambda: MemoryOptions(gpu_memory=10, reserve=10), "--reserve 10 bytes must be"),
        (lambda: MemoryOptions(round_bytes=0), "--round-bytes must be at least 1"),
        (lambda: MemoryOptions(fsdp_placement="x"), "--fsdp-placement 'x' is not one of"),
    ],
)
def test_each_piece_checks_its_fields(make, message):
    with pytest.raises(YafsdpError, match=message):
        make()


def test_a_command_holds_its_pieces_whole():
    opts = VerifyOptions(layout=LayoutOptions(filters=["linear"]), steps=2)
    assert opts.layout == LayoutOptions(filters=("linear",))
    assert opts.step.optimizer == "adamw" and opts.steps == 2
    assert (opts.layout.filters, opts.step.optimizer, opts.layout.world_size) == (
        ("linear",),
        "adamw",
        1,
    )
    assert not hasattr(opts, "filters")  # read through the piece, never flattened


def test_a_command_takes_only_its_own_options():
    with pytest.raises(TypeError):
        VerifyOptions(param_dtype="bf16")
    with pytest.raises(YafsdpError, match="--steps must be at least 1"):
        VerifyOptions(steps=0)
    with pytest.raises(YafsdpError, match="--modules must be 0 or more, got -1"):
        ProfileOptions(modules=-1)
    with pytest.raises(YafsdpError, match="give --gpu-memory"):
        PlanOptions()


def test_a_malformed_filter_fails_when_the_layout_is_made():
    for field in ("filters", "excludes", "freeze"):
        piece = StepOptions if field == "freeze" else LayoutOptions
        with pytest.raises(FilterError):
            piece(**{field: ("re:(",)})


def test_replace_pickle_and_recorded_round_trip():
    opts = VerifyOptions(layout=LayoutOptions(filters=("linear",)), steps=2)
    wider = dataclasses.replace(opts, layout=dataclasses.replace(opts.layout, world_size=4))
    assert wider.layout == LayoutOptions(filters=("linear",), world_size=4)
    assert pickle.loads(pickle.dumps(wider)) == wider
    plan = PlanOptions(
        step=dataclasses.replace(PLAN_STEP, param_dtype="bf16"),
        memory=dataclasses.replace(PLAN_MEMORY, gpu_memory=2**32),
        micro_batches=(1, 2),
    )
    assert plan.step.param_dtype == "bfloat16" and plan.step.target == "cuda"
    assert plan.memory.round_bytes is None and plan.round_bytes == 512  # CUDA's kernels
    on_cpu = dataclasses.replace(plan, step=dataclasses.replace(plan.step, target="cpu"))
    assert on_cpu.round_bytes == 1 and on_cpu.memory_config().round_bytes == 1
    assert PlanOptions.from_recorded(plan.recorded()) == plan
    assert list(plan.recorded())[:3] == ["gpu_memory", "world_sizes", "micro_batches"]
    with pytest.raises(TypeError, match="no option nope"):
        PlanOptions.from_recorded({**plan.recorded(), "nope": 1})


def test_a_saved_plan_records_fields_of_the_pieces_and_the_plan():
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    for piece in (LayoutOptions, StepOptions, MemoryOptions):
        names |= {f.name for f in dataclasses.fields(piece)}
    assert set(SAVED) <= names and len(set(SAVED)) == len(SAVED)


def test_command_defaults_differ_where_the_commands_do():
    assert InspectOptions().step.optimizer is None and InspectOptions().memory.round_bytes == 512
    assert ProfileOptions().memory.round_bytes is None
    assert MemoryOptions().rounding("cpu") == 1 and MemoryOptions().rounding("cuda") == 512
    assert MemoryOptions(round_bytes=64).rounding("cuda") == 64
    assert ProfileOptions(step=StepOptions(target="cuda")).kernels == "cuda"
    assert PlanOptions(memory=MemoryOptions(gpu_memory=2**32)).step.seq_len is None
    assert VerifyOptions().step.optimizer_impl == "for-loop"


def test_the_fit_arithmetic():
    assert needed_bytes(6, 2) == 8
    assert fit(6, 2, 8, 0).fits and not fit(7, 2, 8, 0).fits
    assert fit(6, 2, 10, 0).free == 2 and fit(9, 2, 10, 0).free == -1
    assert process_sum(100, 2, 10) == 220
