"""The costs of one training step, per phase, counted on the fake step ``profile --fake`` runs.

``count_step`` builds the model as ``profile --fake`` does (fake weights in the
training dtype, the real batch, CUDA's attention kernels by default: ``target``
``cuda``), takes one uncounted warm-up optimizer step so the optimizer's state
exists, then counts one step with ``op_costs.OpCounter``: forward and loss, backward
(the forward that checkpointed units recompute is counted there, marked
``recompute``), and the optimizer step (the float32 masters' hand-over and copy-back
included). With gradient accumulation (``grad_accum`` above 1) a second micro-batch
is counted between the backward and the optimizer step, as ``LATER`` phases: every
micro-batch after the first runs its kernels, and adds its gradients into the ones
held (``AccumulateGrad``'s adds, the float32 masters' with ``--grad-dtype float32``),
which the first does not: those adds are the ``ACCUMULATE`` phase, since a sharded
rank makes them on its shards alone; ``step_estimate`` times a later micro-batch
once per later micro-batch.
The model is the original one on one GPU: sharding moves bytes between ranks
(``comm_volume``), it does not change a rank's kernels, except the optimizer step,
which each rank takes on its own share (``step_estimate``).

>>> from yafsdp_cli.sources import load_source
>>> from yafsdp_cli.options import StepOptions
>>> from yafsdp_cli.profiling import ProfileOptions
>>> costs = count_step(load_source(None, model="sample_models.models:llama"),
...                    ProfileOptions(step=StepOptions(target="cuda", seq_len=64), fake=True))
>>> costs.phase("backward").model_flops == 2 * costs.phase("forward").model_flops
True
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.choices import layer_period
from ..engine.idioms import apply_checkpointing
from ..engine.losses import loss_for
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.train_step import make_batch, make_optimizer, run_forward
from ..errors import YafsdpError
from ..options import LayoutOptions, StepOptions
from ..profiling.fake import FakeStep, entered, fake_copy, fake_errors, make_fake_mode
from ..profiling.kernels import CudaAttention
from ..profiling.layer_stack import cut, find_stack
from ..profiling.precision import Masters, cast_params
from ..profiling.profile_options import ProfileOptions
from ..profiling.profiler import warm_up
from .op_costs import OpCost, OpCounter
from .periodic_costs import extrapolate

PHASES = ("forward", "backward", "optimizer")
# the forward and backward of a micro-batch after the first (``grad_accum`` above 1),
# and its adds into the gradients held
LATER = ("later_forward", "later_backward")
ACCUMULATE = "accumulate"


@dataclass(frozen=True, slots=True)
class PhaseCosts:
    """One phase's totals over its kernels."""

    phase: str
    matrix_flops: dict[str, int]  # dtype -> FLOPs the kernels compute
    model_flops: int  # useful matrix FLOPs (no recompute, full attention)
    recompute_flops: int  # matrix FLOPs of checkpointing's recomputed forward
    vector_flops: int
    bytes: int
    kernels: int


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A step's costs: per phase, and every kernel for the roofline."""

    phases: tuple[PhaseCosts, ...]
    ops: tuple[OpCost, ...]
    tokens: int  # batch x sequence length
    params: int  # trainable parameter elements (tied ones once)
    optimizer_impl: str
    attention: dict[str, int]  # CUDA attention kernels by kind (flash, efficient, math)
    checkpointing: str
    # the layers counted: "" for the whole model; else the depths counted and written
    # (``periodic_costs``), or why the whole model was counted
    counted: str = ""
    # micro-batches per optimizer step; above 1 ``ops`` hold a later one's (``LATER``)
    grad_accum: int = 1

    def phase(self, name: str) -> PhaseCosts:
        return next(p for p in self.phases if p.phase == name)

    @property
    def model_flops(self) -> int:
        return sum(p.model_flops for p in self.phases)


def count_step(loaded, opts: ProfileOptions | None = None, *, periodic: bool = True) -> StepCosts:
    """The step's costs for ``loaded`` (``sources.load_source``'s result, or a module
    on the meta device or with real weights, which are never read) under ``opts``
    (``fake`` is implied; ``target`` None means ``cuda``: the kernels a GPU runs).
    With ``periodic``, a model with a stack of repeated layers is counted cut to a
    few of them and written at its depth (``periodic_costs``), where that checks out;
    ``StepCosts.counted`` says which."""
    opts = opts or ProfileOptions(step=StepOptions(target="cuda"), fake=True)
    module, spec = _source_module(loaded)
    every = layer_period(opts.step.checkpointing)
    stack = find_stack(module, every) if periodic else None
    if stack is not None:
        depths = (stack.traced, stack.checked, stack.checked + stack.period)
        if sum(depths) < stack.depth:
            got = _periodic(module, spec, opts, stack, depths)
            if isinstance(got, StepCosts):
                return got
            whole = _count(module, spec, opts)
            return dataclasses.replace(whole, counted=f"{stack.depth} layers: {got}")
    return _count(module, spec, opts)


def _periodic(module, spec, opts, stack, depths) -> StepCosts | str:
    """The step counted at ``depths`` and written at the stack's depth, or why not."""
    try:
        short = []
        for depth in depths:
            with cut(module, stack, depth) as cut_module:
                short.append(_count(cut_module, spec, opts))
    except YafsdpError:
        raise  # the model's own error (a sequence past its positions): the whole one has it too
    except Exception as exc:  # noqa: BLE001 - a cut model's forward may refuse: count whole
        return f"the model cut to {depths[0]} layers did not run ({type(exc).__name__})"
    periods = (stack.depth - depths[0]) // stack.period
    got = extrapolate(short, periods)
    if isinstance(got, str):
        return got
    ops, params, attention = got
    listed = ", ".join(map(str, depths))
    return dataclasses.replace(
        short[0],
        ops=ops,
        phases=tuple(phase_totals(ops, phase) for phase in PHASES),
        params=params,
        attention=attention,
        counted=f"{listed} of {stack.depth} layers, a period repeated, checked",
    )


def _count(module, spec, opts: ProfileOptions) -> StepCosts:
    fake_mode = make_fake_mode()
    with fake_errors(True):
        with fake_mode:
            model = fake_copy(module, spec, "cpu")
            cast_params(model, opts.step.param_dtype)
            model.train()
            units = plan(spec_from_module(model), LayoutOptions(units=opts.layout.units)).blocks
            apply_checkpointing(model, opts.step.checkpointing, units)
        batch = loss_for(model, opts.step).batch(make_batch(model, opts.step))
        cuda = (opts.step.target or "cuda") == "cuda"
        attention = CudaAttention() if cuda else None
        counter = OpCounter()
        impl = (
            "foreach" if opts.step.optimizer_impl == "auto" and cuda else opts.step.optimizer_impl
        )
        with entered(fake_mode, FakeStep(), attention, counter):
            _counted_step(model, batch, opts, impl, counter)
    return _totals(counter.costs, opts, impl, model, attention)


def _source_module(loaded) -> tuple[nn.Module, object]:
    if isinstance(loaded, nn.Module):
        return loaded, None
    if loaded.module is None:
        loaded.build_module()  # raises: counting needs an architecture
    return loaded.module, loaded.spec


def _counted_step(model, batch, opts: ProfileOptions, impl: str, counter: OpCounter) -> None:
    params = list(model.parameters())
    masters = Masters(model, params, opts.step.grad_dtype) if opts.step.param_dtype else None
    stepped = masters.stepped if masters else params
    opt = make_optimizer(opts.step.optimizer, stepped, impl)
    counter.phase = None  # the warm-up step is not counted
    warm_up(opt, stepped)
    _micro_batch(model, batch, opts, counter, ("forward", "backward"))
    counter.phase = "optimizer"
    if masters is not None:
        masters.after_backward()  # the first micro-batch's hand-over, once a step
    if opts.step.grad_accum > 1:
        held = [p.grad for p in [*params, *stepped] if p.grad is not None]
        counter.held, counter.held_phase = frozenset(map(id, held)), ACCUMULATE
        _micro_batch(model, batch, opts, counter, LATER)
        if masters is not None:
            masters.after_backward()  # a later micro-batch's: adds in float32
    counter.phase = "optimizer"
    if masters is not None:
        masters.before_step()
    if opt is not None:
        opt.step()
    if masters is not None:
        masters.after_step()
    counter.phase = None


def _micro_batch(model, batch, opts: ProfileOptions, counter: OpCounter, phases) -> None:
    """Forward, loss and backward, counted as ``phases`` (forward's, backward's)."""
    counter.phase = phases[0]
    torch.manual_seed(opts.step.seed)
    loss_of = loss_for(model, opts.step)
    with loss_of.running():
        loss = loss_of(run_forward(model, batch))
        counter.phase = phases[1]
        _backward(loss)
        del loss


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with ``CudaAttention`` still on for recomputed forwards:
    a ``TorchFunctionMode`` is off for the length of a ``Tensor.backward`` call, so
    the engine is called directly (as ``profiling.profiler`` does, for the same reason).
    The seed gradient is made with grad off: ``OpCounter`` marks a backward op run with
    grad on as recomputed forward, and this one is not (its kernel is the same either
    way)."""
    from torch.autograd.graph import _engine_run_backward

    with torch.no_grad():
        grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    _engine_run_backward(
        (loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _totals(costs, opts, impl, model, attention) -> StepCosts:
    ops = tuple(c for c in costs if c.phase is not None)
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    return StepCosts(
        phases=tuple(phase_totals(ops, phase) for phase in PHASES),
        ops=ops,
        tokens=opts.step.batch * opts.step.seq_len,
        params=sum(trainable.values()),
        optimizer_impl=impl,
        attention=dict(attention.used) if attention else {},
        checkpointing=opts.step.checkpointing,
        grad_accum=opts.step.grad_accum,
    )


def phase_totals(ops, phase: str) -> PhaseCosts:
    mine = [c for c in ops if c.phase == phase]
    by_dtype: Counter[str] = Counter()
    for c in mine:
        if c.matrix_flops:
            by_dtype[c.dtype] += c.matrix_flops
    return PhaseCosts(
        phase=phase,
        matrix_flops=dict(by_dtype),
        model_flops=sum(c.model_flops for c in mine),
        recompute_flops=sum(c.matrix_flops for c in mine if c.recompute),
        vector_flops=sum(c.vector_flops for c in mine),
        bytes=sum(c.bytes for c in mine),
        kernels=len(mine),
    )
