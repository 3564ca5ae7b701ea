"""The options model: pieces validate once; commands' options are made of them."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.inspection.inspect_options import InspectOptions
from yafsdp_cli.memory.headroom import fit, needed_bytes, process_sum
from yafsdp_cli.options import LayoutOptions, MemoryOptions, StepOptions, route
from yafsdp_cli.planning import PlanOptions
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


def test_flat_keywords_are_stored_in_the_pieces_that_own_them():
    opts = VerifyOptions(filters=["linear"], optimizer="sgd", steps=2)
    assert opts.layout == LayoutOptions(filters=("linear",))
    assert opts.step.optimizer == "sgd" and opts.steps == 2
    assert (opts.filters, opts.optimizer, opts.world_size) == (("linear",), "sgd", 1)
    assert VerifyOptions(layout=LayoutOptions(filters=("linear",)), steps=2).filters == ("linear",)
    assert route({"world_size": 2, "seed": 1, "reserve": 0}) == {
        "layout": {"world_size": 2},
        "step": {"seed": 1},
        "memory": {"reserve": 0},
    }


def test_a_command_takes_only_its_own_options():
    with pytest.raises(TypeError, match="VerifyOptions has no option param_dtype"):
        VerifyOptions(param_dtype="bf16")
    with pytest.raises(YafsdpError, match="--steps must be at least 1"):
        VerifyOptions(steps=0)
    with pytest.raises(YafsdpError, match="--modules must be 0 or more, got -1"):
        ProfileOptions(modules=-1)
    with pytest.raises(YafsdpError, match="give --gpu-memory"):
        PlanOptions()


def test_replace_pickle_and_flat_round_trip():
    opts = VerifyOptions(filters=("linear",), steps=2)
    wider = dataclasses.replace(opts, world_size=4)
    assert wider.layout == LayoutOptions(filters=("linear",), world_size=4)
    assert pickle.loads(pickle.dumps(wider)) == wider
    plan = PlanOptions(gpu_memory=2**32, param_dtype="bf16", micro_batches=(1, 2))
    assert plan.param_dtype == "bfloat16" and plan.target == "cuda" and plan.round_bytes == 512
    assert PlanOptions(**plan.flat()) == plan
    assert list(plan.flat())[:3] == ["gpu_memory", "world_sizes", "micro_batches"]


def test_command_defaults_differ_where_the_commands_do():
    assert InspectOptions().optimizer is None and InspectOptions().round_bytes == 512
    assert ProfileOptions().round_bytes is None and ProfileOptions(target="cuda").kernels == "cuda"
    assert PlanOptions(gpu_memory=2**32).seq_len is None


def test_the_fit_arithmetic():
    assert needed_bytes(6, 2) == 8
    assert fit(6, 2, 8, 0).fits and not fit(7, 2, 8, 0).fits
    assert fit(6, 2, 10, 0).free == 2 and fit(9, 2, 10, 0).free == -1
    assert process_sum(100, 2, 10) == 220
