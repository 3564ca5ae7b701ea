"""``--grad-accum N``: a step of N micro-batches, then one optimizer step.

The fake step traces three micro-batches and writes the others from the third
(``profiling/micro_batches.py``); a real step runs every one. So a real step of N
against the fake one checks the written micro-batches to the byte, as the layer
repeat is checked against a real step: the peak, its breakdown, each phase's peak,
what is left after the step, and the micro-batch each peak is in.
"""

from __future__ import annotations

import pytest
from helpers import build, options

from yafsdp_cli import plan, spec_from_module
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.profiling.profiler import profile_converted
from yafsdp_cli.sources import load_source


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def both(source, **kw):
    real = profile_model(source(), options(ProfileOptions, fake=False, **kw))
    fake = profile_model(source(), options(ProfileOptions, fake=True, **kw))
    return real, fake


def assert_same_step(real, fake) -> None:
    for a, b in ((real.original, fake.original), (real.converted_step, fake.converted_step)):
        assert a.peak == b.peak, a.variant
        assert a.phase_peaks == b.phase_peaks, a.variant
        assert a.phase_breakdowns == b.phase_breakdowns, a.variant
        assert a.end == b.end, a.variant
        assert (a.peak_phase, a.peak_micro_batch) == (b.peak_phase, b.peak_micro_batch)
        assert a.phase_micro_batches == b.phase_micro_batches, a.variant


@pytest.mark.parametrize(
    "kw",
    [
        {"world_size": 1},
        {"world_size": 2},
        {"world_size": 4, "param_dtype": "bf16", "grad_dtype": "fp32"},
    ],
    ids=["one-rank", "sharded", "bf16-fp32-grads"],
)
def test_fake_step_of_n_micro_batches_equals_the_real_one(sample_name, kw):
    real, fake = both(lambda: loaded(sample_name), grad_accum=5, **kw)
    assert_same_step(real, fake)
    for step in (fake.original, fake.converted_step):
        assert step.micro.repeated and step.micro.traced == 3, step.micro.why
        assert step.phase_micro_batches["optimizer"] == 5
    assert not real.converted_step.micro.repeated and real.converted_step.micro.traced == 5
    assert fake.grad_accum == 5 and any("5 micro-batches" in n for n in fake.notes)


def test_the_gradients_are_held_through_the_later_micro_batches():
    """One micro-batch: the forward holds no gradient. Two: the second's forward holds
    every gradient of the first (the original's per parameter, the converted flat
    gradient buffer), and that is where the forward's peak is."""
    one = profile_model(loaded("mlp"), options(ProfileOptions, fake=True))
    two = profile_model(loaded("mlp"), options(ProfileOptions, fake=True, grad_accum=2))
    model = build("mlp")
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = sum(b.nbytes for b in plan(spec_from_module(model)).buffers)
    for step, held in ((two.original, grads), (two.converted_step, flat)):
        assert step.phase_breakdowns["forward"].gradients == held
        assert step.phase_micro_batches["forward"] == 2
    for step in (one.original, one.converted_step):
        assert step.phase_breakdowns["forward"].gradients == 0


def test_sharded_micro_batches_hold_the_reduced_shards():
    """At world size 4 each micro-batch reduce-scatters its gradients and adds the
    shard to what the earlier ones left: the later forwards hold shards, not whole
    gradients."""
    opts = options(ProfileOptions, fake=True, grad_accum=3, world_size=4)
    r = profile_model(loaded("llama"), opts)
    layout = plan(spec_from_module(build("llama")), LayoutOptions(world_size=4))
    shards = sum(b.nbytes // 4 for b in layout.buffers if b.requires_grad)
    assert r.converted_step.phase_breakdowns["forward"].gradients == shards


def test_a_micro_batch_that_differs_is_traced_whole():
    """A model that runs another op from its third micro-batch on: the check finds the
    third is not the second repeated, every micro-batch is traced, and the figures
    are the real step's."""
    real, fake = both(lambda: load_source(None, model="accum_models:drift"), grad_accum=5)
    assert_same_step(real, fake)
    how = fake.original.micro
    assert not how.repeated and how.traced == 5
    assert "the third micro-batch is not the second repeated" in how.why


@pytest.mark.parametrize("kw", [{}, {"world_size": 4, "target": "cuda"}])
def test_phase_peaks_alone_equal_the_replays_with_micro_batches(kw):
    steps: dict = {}
    opts = options(ProfileOptions, fake=True, grad_accum=4, **kw)
    profile_converted(loaded("gpt"), opts, steps=steps)
    events = steps["converted"].events
    timeline = events.replay()
    peaks, breakdowns, micro = events.phase_peaks()
    assert (peaks, breakdowns, micro) == (
        timeline.phase_peaks,
        timeline.phase_breakdowns,
        timeline.phase_micro_batches,
    )
    assert micro["optimizer"] == 4 and micro["forward"] == 2


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.5])
def test_grad_accum_out_of_range_is_refused(bad):
    from yafsdp_cli import YafsdpError
    from yafsdp_cli.options import StepOptions

    with pytest.raises(YafsdpError, match="--grad-accum must be"):
        StepOptions(grad_accum=bad)
