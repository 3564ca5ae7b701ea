"""A sharded fake step rewritten for another world size (``profiling.shard_sizes``)
records what the step run at that world size records, event for event; and a plan
made so equals the plan whose every run is a fake step of its own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import options

from yafsdp_cli.planning import PlanOptions, plan_model
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.profiling.profiler import profile_converted
from yafsdp_cli.profiling.shard_sizes import RecordedStep
from yafsdp_cli.sources import load_source

LORA = "r=4,alpha=8,targets=q_proj,v_proj"
SIZES = (2, 4, 8, 64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import tiny_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(path)
    return load_source(path)


def recorded(loaded, world_size: int, **kw) -> RecordedStep:
    steps: dict = {}
    base = dict(batch=2, seq_len=32, fake=True, target="cuda", param_dtype="bf16")
    base.update(round_bytes=512, optimizer_impl="foreach")
    profile_converted(
        loaded, options(ProfileOptions, world_size=world_size, **{**base, **kw}), steps=steps
    )
    return steps["converted"]


def same_step(got, own) -> bool:
    """Equal but for the count of ops: zeroing a padding of none is no op."""
    return dataclasses.replace(got, ops=0) == dataclasses.replace(own, ops=0)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"checkpointing": "non-reentrant"},
        {"checkpointing": "reentrant", "grad_dtype": "fp32"},
        {"param_dtype": "fp32", "target": "cpu", "optimizer_impl": "auto"},
        {"optimizer": "sgd", "align": "megatron"},
        {"align": "none", "checkpointing": "non-reentrant"},
        {"lora": LORA, "freeze": ("embedding",), "quantize": "nf4"},
    ],
    ids=[
        "bf16",
        "non-reentrant",
        "reentrant-fp32-grads",
        "fp32-cpu",
        "sgd-megatron",
        "align-none",
        "lora-nf4",
    ],  # fmt: skip
)
def test_a_rewritten_step_is_the_step_at_that_world_size(llama, kw):
    step = recorded(llama, SIZES[0], **kw)
    assert step.rewritable and step.shards.tags
    for ws in SIZES[1:]:
        assert same_step(step.at_world_size(ws), recorded(llama, ws, **kw).events), ws


@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_sample_models_rewrite_exactly(name):
    loaded = load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")
    step = recorded(loaded, 2, seq_len=16, checkpointing="non-reentrant")
    assert step.rewritable
    for ws in (4, 16):
        own = recorded(loaded, ws, seq_len=16, checkpointing="non-reentrant")
        assert same_step(step.at_world_size(ws), own.events), ws


def test_what_cannot_be_rewritten_is_not(llama):
    whole = recorded(llama, 1)
    assert whole.shards is None and whole.at_world_size(4) is None
    step = recorded(llama, 2)
    assert step.at_world_size(1) is None and step.at_world_size(2) is step.events
    block = next(iter(step.shards.tags))
    tags = {**step.shards.tags, block: (0, True, 8)}  # a size its events never had
    wrong = dataclasses.replace(step, shards=dataclasses.replace(step.shards, tags=tags))
    assert wrong.at_world_size(4) is None
    unclean = dataclasses.replace(step, shards=dataclasses.replace(step.shards, clean=False))
    assert not unclean.rewritable and unclean.at_world_size(4) is None


def test_a_plan_of_rewritten_steps_equals_one_of_fake_steps_alone(llama, monkeypatch):
    """World sizes 1..8: the runs above world size 1 take one step per micro-batch and
    checkpointing choice, and give what a step per cell gives."""
    opts = options(
        PlanOptions,
        gpu_memory=1 << 30,
        reserve=0,
        world_sizes=(1, 2, 4, 8),
        micro_batches=(1, 2, 4),
        checkpointing=("none", "non-reentrant"),
        seq_len=64,
        jobs=1,
    )
    shared = plan_model(llama, opts)
    monkeypatch.setattr(RecordedStep, "at_world_size", lambda self, ws: None)
    alone = plan_model(llama, opts)
    assert shared.rows == alone.rows and shared.best == alone.best
    assert shared.fake_runs == alone.fake_runs == alone.fake_steps
    assert shared.fake_steps < alone.fake_steps
    assert any(f"from {shared.fake_steps} fake steps" in n for n in shared.notes)


def test_the_runner_takes_one_step_per_choice_above_world_size_one(llama):
    """The cells of one micro-batch and checkpointing above world size 1 are one fake
    step; each cell's figures are those of a step run at its own world size."""
    from yafsdp_cli.planning.cell import Cell
    from yafsdp_cli.planning.measure import Runner, measure_peaks

    opts = options(PlanOptions, gpu_memory=1 << 30, world_sizes=(2, 4, 8), seq_len=64, jobs=1)
    runner = Runner(llama, opts, 64, lambda ws: 0)
    cells = [Cell.at(ws, mb, "none") for ws in (1, 2, 4, 8) for mb in (1, 2)]
    runner.prefetch(cells)
    assert (runner.runs, runner.steps) == (8, 4)
    for cell in cells:
        assert runner.figures(cell) == measure_peaks(llama, opts, 64, cell), cell
    assert (runner.runs, runner.steps) == (8, 4)  # asked again: nothing run
