"""The step-time model with ``--grad-accum N``: the first micro-batch's kernels, then
a later micro-batch's (counted: the same kernels, and its gradient adds) N - 1 times,
the optimizer once; all-gathers in every micro-batch, reductions as the scheme does
them; tokens per step N x micro-batch x sequence length."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from helpers import options

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.options import LayoutOptions, StepOptions
from yafsdp_cli.planning import PlanOptions, plan_model
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.schemes import DDP, FLAT, FSDP2
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import count_step, estimate_step, gpu_spec
from yafsdp_cli.timing.comm_volume import collectives
from yafsdp_cli.timing.roofline import efficiency_for
from yafsdp_cli.timing.step_costs import ACCUMULATE, LATER
from yafsdp_cli.timing.step_estimate import phase_times

SEQ = 64
GPU = gpu_spec("h100-sxm")


def llama():
    return load_source(None, model="sample_models.models:llama")


def counts(n: int, **step):
    opts = ProfileOptions(step=StepOptions(target="cuda", seq_len=SEQ, grad_accum=n, **step))
    return count_step(llama(), opts)


@pytest.mark.parametrize("step", [{}, {"param_dtype": "bf16", "grad_dtype": "fp32"}])
def test_a_later_micro_batch_runs_the_first_ones_kernels_and_adds_its_gradients(step):
    one, four = counts(1, **step), counts(4, **step)
    first = [o for o in four.ops if o.phase not in (*LATER, ACCUMULATE)]
    assert first == list(one.ops)  # the first micro-batch and the optimizer: as one
    later = {p: [o for o in four.ops if o.phase == p] for p in (*LATER, ACCUMULATE)}

    def kernels(ops):
        return [(o.name, o.dtype, o.matrix_flops, o.bytes, o.recompute) for o in ops]

    for phase, again in zip(("forward", "backward"), LATER):
        assert kernels(later[again]) == kernels([o for o in one.ops if o.phase == phase])
    trainable = [p for p in llama().build_module().parameters() if p.requires_grad]
    adds = Counter(o.name for o in later[ACCUMULATE])
    assert adds == Counter({"aten.add_.Tensor": len(trainable)})  # one per gradient held
    if not step:  # each add reads the gradient held and the new one, writes the first
        held = sum(3 * p.numel() * p.element_size() for p in trainable)
        assert sum(o.bytes for o in later[ACCUMULATE]) == held


def times(costs):
    return phase_times(costs, GPU, efficiency_for(GPU))  # estimate_step's default


def above_floor(phase) -> float:
    return phase.seconds - phase.kernels * efficiency_for(GPU).kernel_floor_s


@pytest.mark.parametrize("world", [1, 8])
def test_the_optimizer_is_paid_once_and_tokens_are_every_micro_batch(world):
    one, four = counts(1), counts(4)
    layout = plan(llama().spec, LayoutOptions(world_size=world))
    later = times(four)
    for scheme in (FLAT, DDP, FSDP2):
        a, b = (estimate_step(c, layout, GPU, scheme=scheme) for c in (one, four))
        assert b.optimizer_s == a.optimizer_s
        assert b.tokens == 4 * a.tokens == 4 * 2 * SEQ
        assert b.forward_s == pytest.approx(a.forward_s + 3 * later["later_forward"].seconds)
        # the adds on the part of the gradients the rank holds, as its optimizer steps
        # its part of the parameters: what the optimizer's time says that part is
        share = 1.0 if scheme is DDP else above_floor_share(a, times(one)["optimizer"])
        adds = later[ACCUMULATE].seconds - (1 - share) * above_floor(later[ACCUMULATE])
        assert b.backward_s == pytest.approx(
            a.backward_s + 3 * (later["later_backward"].seconds + adds)
        )
        assert b.step_s == pytest.approx(
            b.forward_s + b.backward_s + b.exposed_comm_s + b.optimizer_s
        )
        per_micro = a.model_flops - one.phase("optimizer").model_flops
        assert b.model_flops == a.model_flops + 3 * per_micro
        assert b.tokens_per_s == pytest.approx(b.tokens / b.step_s)


def above_floor_share(estimate, optimizer) -> float:
    """The part of the optimizer's work above the launch floor a rank's step took."""
    floor = optimizer.kernels * efficiency_for(GPU).kernel_floor_s
    return (estimate.optimizer_s - floor) / above_floor(optimizer)


def test_a_sharded_rank_adds_into_its_shards_alone():
    """At 8 ranks the flat runtime's later micro-batches add into its shards: above
    the launch floor their adds cost an eighth of DDP's, which holds every gradient."""
    one, four = counts(1), counts(4)
    layout = plan(llama().spec, LayoutOptions(world_size=8))
    later = times(four)

    def adds(scheme) -> float:
        a, b = (estimate_step(c, layout, GPU, scheme=scheme) for c in (one, four))
        return (b.backward_s - a.backward_s) / 3 - later["later_backward"].seconds

    floor = later[ACCUMULATE].seconds - above_floor(later[ACCUMULATE])
    assert adds(DDP) == pytest.approx(later[ACCUMULATE].seconds)
    assert adds(FLAT) - floor == pytest.approx(above_floor(later[ACCUMULATE]) / 8, rel=0.05)


def test_reductions_follow_the_scheme():
    """At 8 ranks: the flat runtime and FSDP2 (gradient sync on) gather and reduce in
    every micro-batch; DDP (no_sync) reduces once, and FSDP2 with sync off too, while
    it still gathers in every micro-batch."""
    one, four = counts(1), counts(4)
    layout = plan(llama().spec, LayoutOptions(world_size=8))

    def sent(scheme, kind=None):
        return sum(c.sent for c in collectives(layout, scheme) if kind in (None, c.kind))

    for scheme in (FLAT, FSDP2):
        assert estimate_step(four, layout, GPU, scheme=scheme).sent_bytes == 4 * sent(scheme)
    assert estimate_step(four, layout, GPU, scheme=DDP).sent_bytes == sent(DDP)
    no_sync = estimate_step(four, layout, GPU, scheme=FSDP2, reduce_every_micro_batch=False)
    gathers = sent(FSDP2, "all_gather")
    assert no_sync.sent_bytes == 4 * gathers + sent(FSDP2, "reduce_scatter") < 4 * sent(FSDP2)
    every = estimate_step(four, layout, GPU, scheme=DDP, reduce_every_micro_batch=True)
    assert (
        every.sent_bytes == 4 * sent(DDP)
        and every.comm_s > estimate_step(four, layout, GPU, scheme=DDP).comm_s
    )
    assert estimate_step(one, layout, GPU, scheme=DDP).sent_bytes == sent(DDP)


def test_plan_rows_are_timed_with_their_micro_batches():
    opts = options(
        PlanOptions, gpu="h100-sxm", seq_len=SEQ, world_sizes=(1, 8), micro_batches=(1, 2, 3),
        checkpointing=("none",), jobs=1,
    )  # fmt: skip
    four = dataclasses.replace(opts, step=dataclasses.replace(opts.step, grad_accum=4))
    a, b = plan_model(llama(), opts), plan_model(llama(), four)
    for x, y in zip(a.rows, b.rows):
        assert y.time.tokens == 4 * x.time.tokens == 4 * x.micro_batch * SEQ
        assert y.time.optimizer_s == pytest.approx(x.time.optimizer_s)
        assert y.time.step_s > x.time.step_s
