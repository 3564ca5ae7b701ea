"""Gradient accumulation in the engine: N micro-batches' gradients, accumulated in
the flat gradient buffer (one process) or in the reduced shards (ranks), equal the
original model's accumulated gradients exactly, tied weights included, and the next
step starts from nothing whichever way the gradients are zeroed."""

from __future__ import annotations

import pytest
from accum_ranks import Case, launch
from helpers import assert_records_equal, build, convert_copy, run_steps


@pytest.mark.parametrize("micro", [1, 4])
@pytest.mark.parametrize("on", ["flat", "params"])
def test_accumulated_micro_batches_equal_the_original(sample_name, micro, on):
    """``run_steps`` feeds each micro-batch its own inputs; the optimizer steps on the
    flat buffers (metaparam) or on the module's parameters (training code as it is)."""
    model = build(sample_name)
    twin, flat = convert_copy(model, world_size=4)
    ref = run_steps(model, steps=2, micro=micro, optimizer="sgd")
    got = run_steps(twin, flat, steps=2, micro=micro, optimizer="sgd", on=on)
    assert_records_equal(ref, got)
    flat.check_padding()


def test_a_tied_weight_accumulates_both_uses_of_every_micro_batch():
    model = build("gpt")
    twin, flat = convert_copy(model)
    ref = run_steps(model, steps=2, micro=4, optimizer="none")
    got = run_steps(twin, flat, steps=2, micro=4, optimizer="none")
    for r, g in zip(ref, got):
        expected = r["grads"]["transformer.wte.weight"]
        assert expected.abs().sum() > 0
        for name in ("transformer.wte.weight", "lm_head.weight"):
            assert g["grads"][name].equal(expected), name


@pytest.mark.parametrize("door", ["optimizer", "optimizer-zeros", "sharded"])
def test_sharded_ranks_accumulate_and_reset_by_every_door(tmp_path, door):
    """Two gloo ranks, four micro-batches per step, three steps: every gradient (the
    shards' and the unconverted norms', tied names too) and every parameter equal the
    reference to the bit, after each step."""
    results = launch(Case(door), tmp_path)
    for rank, steps in enumerate(results):
        assert len(steps) == 3
        for step, diff in enumerate(steps):
            assert diff == {"grads": [], "params": []}, (rank, step, diff)
