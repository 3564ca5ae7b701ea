"""Profile one training step of the original and of the converted model.

``profile_model`` builds the model (real, or fake: every parameter and buffer
replaced by a FakeTensor of the same shape and dtype, so a model that does not fit
costs no memory; see ``fake.py`` for how the fake step keeps the real step's
kernels), takes one warm-up optimizer step on zero gradients so the optimizer state
exists (the steady state every later step sees), then tracks one step: forward and
loss, backward, optimizer step and ``zero_grad``. Then it converts the same module
in place and does the same again; with ``world_size > 1`` the converted model runs
as rank 0 of that many (``sharded.ShardedFlat`` with ``LocalComm``): shards persist,
each unit's buffers are gathered while it runs.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch
from torch import nn

from ..engine.choices import layer_period
from ..engine.flat import convert_module
from ..engine.idioms import apply_checkpointing
from ..engine.losses import batch_logits, loss_for, resolve_loss
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.records import retype_params
from ..engine.sharded import LocalComm, ShardedFlat
from ..engine.train_step import (
    Batch,
    make_batch,
    make_optimizer,
    optimizer_tensors,
    run_forward,
)
from ..errors import YafsdpError
from ..options.training_dtype import training_dtype
from ..sources.adapted import adapt, keeps_stored_base
from . import micro_batches
from .fake import FakeStep, entered, fake_copy, fake_errors, make_fake_mode
from .gpu_holding import GpuHolding, gpu_holding, reserved_peak
from .kernels import CudaAttention
from .layer_stack import cut, find_stack
from .micro_batches import MicroTrace
from .modules import module_names, peak_shares, tracking_layers, tracking_modules
from .periodic import NotPeriodicError, PeriodicTrace, matches, repeat
from .positions import index_errors
from .precision import Masters, cast_params
from .profile_options import ProfileOptions
from .profile_report import CudaMemory, ProfileReport, StepProfile
from .shard_sizes import RecordedStep, ShardTags
from .tracker import StorageTracker

# progress(stage, done, total): called as each stage starts (for a progress bar)
STAGES = ("building the model", "original step", "converting", "converted step")


def profile_source(
    source, *, model=None, trust_pickle=False, opts=None, progress=None
) -> ProfileReport:
    from ..sources import load_source

    loaded = load_source(source, model=model, trust_pickle=trust_pickle)
    return profile_model(loaded, opts or ProfileOptions(), progress=progress)


def profile_model(
    loaded, opts: ProfileOptions | None = None, progress=None, traces: dict | None = None
) -> ProfileReport:
    """Profile ``loaded`` (``sources.load_source``): original, then converted.
    ``traces``, if given, gets each variant's ``AllocTrace`` (for
    ``memory.caching_allocator.reserved_of``) under "original" and "converted"."""
    opts = opts or ProfileOptions()
    trained = training_dtype(opts.step.param_dtype, loaded.spec)
    opts = dataclasses.replace(opts, step=dataclasses.replace(opts.step, param_dtype=trained.dtype))
    _check_target(opts)
    loaded = adapt(loaded, opts.step)
    fake_mode = make_fake_mode() if opts.fake else None
    with fake_errors(opts.fake):
        report = _profile(loaded, opts, fake_mode, progress or (lambda *_: None), traces)
    return dataclasses.replace(report, training_dtype=trained.why)


def _check_target(opts: ProfileOptions) -> None:
    if opts.step.device == "cuda" and not torch.cuda.is_available():
        raise YafsdpError("--device cuda: no CUDA device is available; use --device cpu")
    if opts.step.device == "cuda" and opts.kernels == "cpu":
        raise YafsdpError("--target cpu with --device cuda: the step runs CUDA kernels")
    if opts.step.device == "cpu" and opts.kernels == "cuda" and not opts.fake:
        raise YafsdpError(
            "--target cuda on the CPU needs --fake: the CUDA kernels are accounted on fake "
            "tensors; add --fake, or run --device cuda on a GPU"
        )


def profile_converted(
    loaded, opts: ProfileOptions, traces: dict | None = None, steps: dict | None = None
) -> StepProfile:
    """The converted model's step alone (what ``plan`` measures), no original step;
    ``traces`` as in ``profile_model``; ``steps``, if given, gets its
    ``shard_sizes.RecordedStep`` under "converted" (its events, rewritable for another
    world size where it ran sharded) and how it was had (``periodic.PeriodicTrace``)
    under "trace"."""
    _check_target(opts)
    loaded = adapt(loaded, opts.step)
    fake_mode = make_fake_mode() if opts.fake else None
    with fake_errors(opts.fake):
        got = steps_at_depth(loaded, opts, fake_mode, ("converted",), lambda *_: None)
    if steps is not None:
        steps["converted"] = got.steps["converted"]
        steps["trace"] = got.how
    return _step_profile("converted", got, loaded, opts, traces)


def _prepared(loaded, opts: ProfileOptions, fake_mode, stack=None, depth: int | None = None):
    """The module in its training dtype with its layout, units checkpointed if asked
    (on this one model: it is converted in place, never copied), and how it was
    checkpointed, in words. ``depth``: the first that many layers of ``stack`` only
    (a fake step traced for one period, ``periodic``)."""
    module = build_module(loaded, opts, fake_mode, stack, depth)
    cast_params(module, opts.step.param_dtype, keep_frozen=keeps_stored_base(loaded))
    module.train()
    layout = plan(spec_from_module(module), opts.layout)
    ckpt_note = apply_checkpointing(module, opts.step.checkpointing, layout.blocks)
    return module, layout, ckpt_note


def _step_modes(opts: ProfileOptions, fake_mode):
    """The modes a step runs under (the fake mode, the fake step's kernels, CUDA's
    attention where it is substituted), and the attention mode, for its counts."""
    attention = CudaAttention() if _substitutes_cuda(opts) else None
    step_mode = FakeStep() if fake_mode is not None else None
    return attention, (fake_mode, step_mode, attention)


def _convert(module, layout, opts: ProfileOptions):
    """``module`` converted in place; what its optimizer steps on, and the sharded
    runtime (rank 0 of ``world_size``) where there is one."""
    flat = convert_module(module, layout)
    if opts.layout.world_size == 1:
        return flat.parameters(), None
    sharded = ShardedFlat(flat, LocalComm(0, opts.layout.world_size))
    return sharded.parameters(), sharded


@dataclasses.dataclass
class _Traced:
    """One variant's tracked step: its events, and what only the run knows."""

    step: RecordedStep
    wall: float
    cuda: CudaMemory | None
    micro: MicroTrace  # how its micro-batches were had


@dataclasses.dataclass
class _Run:
    """The steps of one build of the model (whole, or cut to fewer layers)."""

    traced: dict[str, _Traced]
    layout: object
    ckpt_note: str
    batch: Batch
    kernels: dict[str, int]
    module: nn.Module


@dataclasses.dataclass
class _Steps:
    """The steps a report is made of: each variant's events at the model's depth, how
    they were had, and the run whose model and layout the report describes."""

    steps: dict[str, RecordedStep]
    how: PeriodicTrace
    run: _Run
    wall: dict[str, float]
    kernels: dict[str, int]
    layout: object


def _run(loaded, opts, fake_mode, variants, progress, stack=None, depth=None) -> _Run:
    """Build the model (``depth`` layers of ``stack`` where given) and track the step
    of each of ``variants`` (original, then converted in place)."""
    total = len(STAGES)
    progress(STAGES[0], 0, total)
    with entered(fake_mode):
        module, layout, ckpt_note = _prepared(loaded, opts, fake_mode, stack, depth)
    batch = _batch(module, opts)
    attention, modes = _step_modes(opts, fake_mode)
    layers = _layers(module, stack) if stack is not None else None
    traced = {}
    with entered(*modes), index_errors(module, opts):
        if "original" in variants:
            progress(STAGES[1], 1, total)
            params = list(module.parameters())
            traced["original"] = _trace_step(module, params, batch, opts, None, layers)
        progress(STAGES[2], 2, total)
        params, sharded = _convert(module, layout, opts)
        progress(STAGES[3], 3, total)
        traced["converted"] = _trace_step(module, params, batch, opts, sharded, layers)
    kernels = dict(attention.used) if attention else {}
    return _Run(traced, layout, ckpt_note, batch, kernels, module)


def steps_at_depth(
    loaded, opts: ProfileOptions, fake_mode, variants, progress, run=None, checked: bool = True
):
    """The steps of ``variants`` at the model's depth (a ``_Steps``): under ``--fake``,
    a short model traced, checked against one a period deeper and repeated
    (``periodic``), where it has a stack of layers deep enough to gain; else, or
    where the check fails, the whole model traced. ``run`` builds and traces the
    model at a depth (``_run``'s arguments; ``_run`` where None: the original and
    the converted model; ``engine_step`` traces an engine's). ``checked`` False: the
    short model repeated unchecked (its caller checks it against another step's)."""
    run = run or _run
    every = layer_period(opts.step.checkpointing)
    stack = find_stack(loaded.module, every) if opts.fake and loaded.module is not None else None
    why = _whole_why(stack, opts)
    if why is None:
        try:
            short = run(loaded, opts, fake_mode, variants, progress, stack, stack.traced)
            check = None
            if checked:
                check = run(loaded, opts, fake_mode, variants, progress, stack, stack.checked)
        except YafsdpError:
            raise
        except Exception as exc:  # noqa: BLE001 - a cut model's forward may refuse; trace whole
            why = f"the model cut to {stack.traced} layers did not run ({type(exc).__name__})"
        else:
            done = _repeated(short, check, stack, variants, loaded, opts)
            if isinstance(done, _Steps):
                return done
            why = done
    whole = run(loaded, opts, fake_mode, variants, progress)
    steps = {v: t.step for v, t in whole.traced.items()}
    depth = (stack.depth,) if stack is not None else ()
    wall = {v: t.wall for v, t in whole.traced.items()}
    return _Steps(steps, PeriodicTrace(False, why, depth), whole, wall, whole.kernels, whole.layout)


def _whole_why(stack, opts: ProfileOptions) -> str | None:
    """Why the step is traced whole, or None where one period of it will do."""
    if not opts.fake:
        return "a real step: every layer runs"
    if not opts.periodic:
        return "--trace whole"
    if stack is None:
        return "the model has no stack of repeated layers"
    if not stack.worth:
        return (
            f"{stack.describe()}: tracing {stack.traced} and {stack.checked} layers would "
            "cost more than the whole"
        )
    return None


def _repeated(short: _Run, check: _Run | None, stack, variants, loaded, opts) -> _Steps | str:
    """The steps at the model's depth from ``short`` where ``check`` confirms them
    (None: unchecked); else why not."""
    if check is None:
        return _unchecked(short, stack, variants)
    steps, wall = {}, {}
    for v in variants:
        a, b = short.traced[v].step, check.traced[v].step
        why = matches(a, b, stack)
        if why is not None:
            return (
                f"{v} step of {stack.traced} layers repeated to {stack.checked} is not the "
                f"traced step of {stack.checked}: {why}"
            )
        ops = b.events.ops - a.events.ops
        steps[v] = repeat(a, stack, stack.depth, ops_per_period=ops)
        wall[v] = short.traced[v].wall + check.traced[v].wall
    periods = (stack.depth - stack.traced) // stack.period
    kernels = {k: n + periods * (check.kernels.get(k, 0) - n) for k, n in short.kernels.items()}
    how = PeriodicTrace(
        True,
        f"{stack.describe()}: traced {stack.traced} and {stack.checked} layers; the "
        f"{stack.depth}-layer step is the {stack.traced}-layer one with a period repeated, "
        f"checked event for event against the {stack.checked}-layer trace",
        (stack.traced, stack.checked),
    )
    layout = plan(
        retype_params(loaded.spec, opts.step.param_dtype, keeps_stored_base(loaded)),
        opts.layout,
    )
    return _Steps(steps, how, short, wall, kernels, layout)


def _unchecked(short: _Run, stack, variants) -> _Steps | str:
    """The steps at the model's depth from ``short``, repeated without a check."""
    steps, wall = {}, {}
    for v in variants:
        try:
            steps[v] = repeat(short.traced[v].step, stack, stack.depth)
        except NotPeriodicError as exc:
            return f"{v} step of {stack.traced} layers is not periodic: {exc}"
        wall[v] = short.traced[v].wall
    how = PeriodicTrace(
        True,
        f"{stack.describe()}: traced {stack.traced} layers; the {stack.depth}-layer step is "
        "that one with a period repeated, unchecked here: its events are those of a step "
        "that was checked, sizes aside",
        (stack.traced,),
    )
    return _Steps(steps, how, short, wall, short.kernels, short.layout)


def _layers(module: nn.Module, stack) -> dict[int, tuple[str, nn.Module]]:
    """Index -> (name, layer) of the stack's layers in ``module``."""
    layers = module.get_submodule(stack.path)
    return {i: (f"{stack.path}.{i}", layer) for i, layer in enumerate(layers)}


def _profile(loaded, opts: ProfileOptions, fake_mode, progress, traces) -> ProfileReport:
    holding = gpu_holding(opts)
    loss = resolve_loss(loaded.module, opts.step.loss)  # a wrong --loss fails before the steps
    got = steps_at_depth(loaded, opts, fake_mode, ("original", "converted"), progress)
    progress("done", len(STAGES), len(STAGES))
    original = _step_profile("original", got, loaded, opts, traces, holding)
    converted = _step_profile("converted", got, loaded, opts, traces, holding)
    layout = got.layout
    return ProfileReport(
        source=loaded.spec.source,
        fake=opts.fake,
        device=opts.step.device,
        target=opts.kernels,
        world_size=opts.layout.world_size,
        optimizer=opts.step.optimizer,
        optimizer_impl=_optimizer_impl(opts),
        checkpointing=opts.step.checkpointing,
        loss=loss.name,
        loss_detail=loss.describe(*batch_logits(loaded.module, got.run.batch)),
        inputs=got.run.batch.describe(),
        round_bytes=_rounding(opts),
        flat_buffers=len(layout.buffers),
        converted=sum(len(b.entries) for b in layout.buffers),
        kept=sum(1 for t in layout.kept if t.is_param),
        original=original,
        converted_step=converted,
        kernels=got.kernels,
        notes=(
            *_notes(opts, got.run.ckpt_note, got.kernels, holding),
            *((f"layers: {got.how.why}",) if opts.fake else ()),
            *_micro_notes(opts, got.run),
            *getattr(loaded, "tuning_notes", ()),
        ),
        outside=holding.outside if holding else None,
        trace=got.how,
        grad_accum=opts.step.grad_accum,
    )


def _micro_notes(opts: ProfileOptions, run: _Run) -> tuple[str, ...]:
    """With --grad-accum: what a step of N micro-batches is, and how each variant's
    micro-batches were had."""
    n = opts.step.grad_accum
    if n == 1:
        return ()
    hows = {v: t.micro.why for v, t in run.traced.items()}
    how = next(iter(hows.values())) if len(set(hows.values())) == 1 else None
    sharded = (
        "; the converted rank reduce-scatters each micro-batch's gradients as its backward "
        "ends and adds the shards to the earlier ones' (the original holds whole gradients)"
        if opts.layout.world_size > 1
        else ""
    )
    return (
        f"gradient accumulation: {n} micro-batches, a forward and a backward each, the "
        f"gradients held from the first backward on, then one optimizer step{sharded}; "
        + (f"micro-batches: {how}" if how else "; ".join(f"{v}: {w}" for v, w in hows.items())),
    )


def _substitutes_cuda(opts: ProfileOptions) -> bool:
    return opts.kernels == "cuda" and opts.step.device == "cpu"


def _rounding(opts: ProfileOptions) -> int:
    return opts.memory.rounding(opts.kernels)


def _optimizer_impl(opts: ProfileOptions) -> str:
    """torch's default (``auto``) for the target: foreach on CUDA, for-loop on the CPU.
    Fake CPU tensors would get the CPU's default, so the CUDA one is named."""
    if opts.step.optimizer_impl == "auto" and _substitutes_cuda(opts):
        return "foreach"
    return opts.step.optimizer_impl


def build_module(
    loaded, opts: ProfileOptions, fake_mode, stack=None, depth: int | None = None
) -> nn.Module:
    """A real module with the weights, or a fake one that holds no memory (of the first
    ``depth`` layers of ``stack`` only, where given: ``periodic``)."""
    if fake_mode is None:
        module = loaded.build_module()
        return module.to("cuda") if opts.step.device == "cuda" else module
    if loaded.module is None:
        loaded.build_module()  # raises: profiling needs an architecture
    if depth is None:
        return fake_copy(loaded.module, loaded.spec, opts.step.device)
    with cut(loaded.module, stack, depth) as short:
        return fake_copy(short, loaded.spec, opts.step.device)


def _batch(module: nn.Module, opts: ProfileOptions) -> Batch:
    """Real tensors, in a fake run too (see ``fake.py``)."""
    batch = loss_for(module, opts.step).batch(make_batch(module, opts.step))
    if opts.step.device == "cuda":
        batch = batch.map(lambda t: t.to("cuda"))
    return batch


def warm_up(opt, params: list[nn.Parameter]) -> None:
    """One step on zero gradients: the optimizer state of a steady-state step."""
    if opt is None:
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trace_step(module, params, batch, opts, sharded=None, layers=None) -> _Traced:
    """Track one step of ``module``, its ``grad_accum`` micro-batches traced or, under
    ``--fake`` (and ``--trace periodic``), three traced and the rest written from the
    third where it repeats the second (``micro_batches``); ``layers`` (``_layers``):
    give each block its layer (``periodic``)."""
    total = opts.step.grad_accum
    traced = micro_batches.traced_count(total, opts.fake and opts.periodic)
    got, marks = _trace_micro_batches(module, params, batch, opts, sharded, layers, traced)
    if traced == total:
        why = "every micro-batch traced" + ("" if total == 1 else _whole_micro_why(opts))
        return dataclasses.replace(got, micro=MicroTrace(total, traced, False, why))
    step = micro_batches.repeat(got.step, marks, total)
    if isinstance(step, RecordedStep):
        rest = "micro-batch 4 is" if total == 4 else f"micro-batches 4 to {total} are"
        why = (
            f"traced {traced} of {total}; {rest} the 3rd repeated, the 3rd checked event "
            "for event against the 2nd"
        )
        return dataclasses.replace(got, step=step, micro=MicroTrace(total, traced, True, why))
    got, _ = _trace_micro_batches(module, params, batch, opts, sharded, layers, total)
    return dataclasses.replace(got, micro=MicroTrace(total, total, False, f"all traced: {step}"))


def _whole_micro_why(opts: ProfileOptions) -> str:
    if not opts.fake:
        return ": a real step runs every micro-batch"
    return ": --trace whole" if not opts.periodic else ""


def _trace_micro_batches(module, params, batch, opts, sharded, layers, count: int):
    """Track one step of ``count`` micro-batches: the ``_Traced`` (its ``micro`` left to
    the caller) and where each micro-batch began (``StorageTracker.micro_marks``)."""
    masters = Masters(module, params, opts.step.grad_dtype) if opts.step.param_dtype else None
    stepped = masters.stepped if masters else params
    opt = make_optimizer(opts.step.optimizer, stepped, _optimizer_impl(opts))
    warm_up(opt, stepped)
    tracker = StorageTracker(_rounding(opts))
    _assign_roles(tracker, module, params, opt, batch)
    if masters is not None:
        tracker.assign(masters.masters(), "optimizer")  # float32 masters: optimizer-owned
    if sharded is not None:
        _tag_shards(tracker, sharded, masters, opt, _rounding(opts))
    names = module_names(module, opts)
    if layers is not None:
        tracker.layer_of = {name: i for i, (name, _) in layers.items()}
        _own_layers(tracker, layers, sharded, masters, opt)
    cuda_before = _cuda_reset(opts.step.device)
    start = time.perf_counter()
    with tracker, tracking_modules(tracker, names), tracking_layers(tracker, layers or {}):
        _tracked_step(tracker, module, params, batch, opt, opts, sharded, masters, count)
    wall = time.perf_counter() - start
    shards = tracker.tags.sizes() if tracker.tags is not None else None
    step = RecordedStep(tracker.recorded(), shards)
    if tracker.owner_clash:
        step = RecordedStep(dataclasses.replace(step.events, owners=None), shards)
    cuda = _cuda_peaks(opts.step.device, cuda_before)
    return _Traced(step, wall, cuda, MicroTrace(count, count, False, "")), tracker.micro_marks


def _own_layers(tracker, layers, sharded, masters, opt) -> None:
    """Give the storages that exist before the step their layer: each layer's
    parameters and buffers, and what follows a parameter (its shard, master and
    optimizer states)."""
    for i, (_, layer) in layers.items():
        tracker.own([*layer.parameters(), *layer.buffers()], i)
    for b, shard in zip(sharded.flat.buffers, sharded.shards) if sharded is not None else ():
        owner = tracker.owner_of(b.param)
        if owner is not None:
            tracker.own(shard, owner)
    for p, m in masters.pairs if masters is not None else ():
        owner = tracker.owner_of(p)
        if owner is not None:
            tracker.own(m, owner)
    for p, state in opt.state.items() if opt is not None else ():
        owner = tracker.owner_of(p)
        if owner is not None:
            tracker.own(list(state.values()), owner)


def _step_profile(variant, got: _Steps, loaded, opts, traces=None, holding=None) -> StepProfile:
    """A variant's figures from its step's events (traced, or repeated from a period)."""
    step = got.steps[variant]
    names = module_names(loaded.module, opts) if opts.per_module else {}
    rows = [n for n in dict.fromkeys(names.values()) if _shallow(n, opts)]
    timeline = step.events.replay(rows)
    trace = step.events.alloc_trace() if traces is not None or holding is not None else None
    if traces is not None:
        traces[variant] = trace
    shape = got.run.module if not got.how.periodic else loaded.module
    return StepProfile(
        variant=variant,
        peak=timeline.peak,
        peak_phase=timeline.peak_phase,
        phase_peaks=timeline.phase_peaks,
        end=timeline.end,
        modules=timeline.modules,
        peak_modules=peak_shares(shape, timeline.peak_by_module, opts.modules),
        cuda=got.run.traced[variant].cuda,
        ops=step.events.ops,
        wall_s=got.wall[variant],
        series=timeline.series,
        reserved=reserved_peak(trace, holding) if holding is not None else None,
        phase_breakdowns=timeline.phase_breakdowns,
        peak_micro_batch=timeline.peak_micro_batch,
        phase_micro_batches=timeline.phase_micro_batches,
        micro=got.run.traced[variant].micro,
    )


def _tag_shards(tracker, sharded, masters, opt, round_bytes: int) -> None:
    """Name the blocks whose size follows the world size (``shard_sizes``), and each
    whole gradient as a gradient as the runtime hands it to the reduce-scatter."""
    tags = tracker.tags = ShardTags(tracker, sharded, round_bytes)
    tags.seed(sharded, masters, opt)

    def reduced(i: int, full: torch.Tensor, part: torch.Tensor) -> None:
        tracker.assign(full, "gradients")
        tags.reduced(i, full, part)

    sharded.on_reduced = reduced


def _shallow(name: str, opts: ProfileOptions) -> bool:
    return name.count(".") < opts.depth


def _assign_roles(tracker, module, params, opt, batch) -> None:
    # converted: params are the flat buffers (or shards); module.parameters() are views
    tracker.assign([*params, *module.parameters()], "parameters")
    tracker.assign(list(module.buffers()), "buffers")
    tracker.assign(optimizer_tensors(opt), "optimizer")
    tracker.assign(batch.tensors(), "activations")


def _tracked_step(tracker, module, params, batch, opt, opts, sharded, masters, count) -> None:
    """``count`` micro-batches, each adding into the gradients the ones before left,
    then one optimizer step and ``zero_grad``."""
    for _ in range(count):
        tracker.mark_micro_batch()
        _micro_batch(tracker, module, batch, opts, sharded, masters)
    tracker.mark_micro_batch()  # the micro-batches end here
    if tracker.tags is not None:
        tracker.tags.start_inheriting()
    if masters is not None:
        tracker.assign(masters.grads(), "gradients")
    tracker.assign([p.grad for p in params if p.grad is not None], "gradients")
    tracker.assign([p.grad for p in module.parameters() if p.grad is not None], "gradients")
    if tracker.layer_of is not None:
        tracker.own_grads([*params, *(masters.stepped if masters else ())])
    tracker.set_phase("optimizer")
    if masters is not None:
        masters.before_step()
    if opt is not None:
        opt.step()
        tracker.assign(optimizer_tensors(opt), "optimizer")
    if masters is not None:
        masters.after_step()
    for p in [*params, *module.parameters(), *(masters.stepped if masters else ())]:
        p.grad = None


def _micro_batch(tracker, module, batch, opts, sharded, masters) -> None:
    """Forward, loss and backward of one micro-batch (the same batch and seed in each:
    ``micro_batches``'s note); the sharded runtime reduces what is left, and with
    ``--grad-dtype float32`` the masters take the gradients in float32."""
    tracker.set_phase("forward")
    torch.manual_seed(opts.step.seed)
    loss_of = loss_for(module, opts.step)
    with loss_of.running():  # a checkpointed head recomputes in the backward
        loss = loss_of(run_forward(module, batch))
        tracker.set_phase("backward")
        _backward(loss)
        del loss
    if sharded is not None:
        sharded.finish_backward()
    if masters is not None:
        masters.after_backward()
        if tracker.tags is not None:
            tracker.tags.master_grads(masters)


def _backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the step's function mode (``CudaAttention``) still on.

    ``Tensor.backward`` and ``torch.autograd.backward`` go through
    ``__torch_function__``, and a ``TorchFunctionMode`` handles a call with itself off
    the stack for the call's length; checkpointed units recompute their forward inside
    backward, so they would recompute with the CPU's attention (and a non-reentrant
    checkpoint then finds other tensors saved than in the forward, and fails). So the
    autograd engine is called the way ``torch.autograd.backward`` calls it."""
    from torch.autograd.graph import _engine_run_backward

    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    _engine_run_backward(
        (loss,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def _on_cuda(device: str) -> bool:
    return device == "cuda" and torch.cuda.is_available()


def _cuda_reset(device: str):
    """Start the step's CUDA figures from a clean allocator: what the previous step, the
    conversion or the warm-up left cached goes back to the driver, and the peaks
    restart, so each step's reserved peak is its own (as the replay's is). Only on a
    GPU; ``tests/profiling/test_profile_reserved.py`` checks the order with the calls stubbed."""
    if not _on_cuda(device):
        return None
    gc.collect()  # the previous step's graph and optimizer may sit in a cycle
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return True


def _cuda_peaks(device: str, started) -> CudaMemory | None:
    if started is None or not _on_cuda(device):
        return None
    torch.cuda.synchronize()
    return CudaMemory(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def _notes(
    opts: ProfileOptions, ckpt_note: str, kernels: dict[str, int], holding: GpuHolding | None
) -> tuple[str, ...]:
    notes = [
        "one warm-up step on zero gradients first, so optimizer state exists as in every "
        "later step; bytes are the storages the step's tensors use, not the allocator's cache",
    ]
    if opts.fake:
        notes.append(
            "fake tensors (FakeTensorMode): weights and activations have shapes and dtypes "
            "only, no memory used; the batch and what it alone makes (positions, masks) are "
            "real, so the model takes the path a real step takes"
        )
    if _substitutes_cuda(opts):
        used = ", ".join(f"{k} x{n}" for k, n in sorted(kernels.items())) or "none called"
        notes.append(
            "--target cuda without a GPU: attention accounted as CUDA's sdpa kernels save it "
            f"({used}; sm80+, default backend order), storages rounded to "
            f"{_rounding(opts)} B (CUDA's caching allocator: 512), the optimizer's CUDA "
            "default (foreach); kernel "
            "workspaces are not counted (see docs/profile.md)"
        )
    if opts.step.param_dtype:
        notes.append(
            f"parameters in {opts.step.param_dtype}; 16-bit ones get float32 masters that the "
            "optimizer steps on (its states float32), counted as optimizer; gradients in "
            f"{opts.step.grad_dtype or opts.step.param_dtype}"
        )
    if holding is not None:
        notes.append(
            f"reserved: the step's allocations replayed through CUDA's caching allocator "
            f"({holding.conf}); the GPU must hold that and the memory outside it: "
            + "; ".join(f"{p.name} ({p.source})" for p in holding.outside.parts)
        )
    if ckpt_note:
        notes.append(f"activation checkpointing: {ckpt_note}")
    if opts.layout.world_size > 1:
        notes.append(
            f"converted: rank 0 of {opts.layout.world_size}; persistent parameters, gradients and "
            "optimizer state are shards, each unit's buffers gathered while it runs; the "
            "original is one whole (DDP-like) replica"
        )
    return tuple(notes)
