"""One rank's fake step under a real training engine: FSDP2's ``fully_shard`` or
``DistributedDataParallel`` wrapping the original (unconverted) model.

[Note: a real engine in the fake step]
As torchtitan's memory estimator does (``scripts/estimate/estimation.py``), the
engine runs for real under ``FakeTensorMode`` and a fake process group (the
``"fake"`` backend of ``torch.distributed``, ``FakeStore``): rank ``r`` of ``N`` calls
every collective the engine calls, the group returns at once and moves no data, and
every tensor the engine makes (shards, all-gather and reduce-scatter buffers, DDP's
buckets, optimizer states) is a fake one of the size the real engine would make on
that rank. The profiler's tracker (``tracker``, looking through FSDP2's ``DTensor``
to its local storage) records the step as it records the flat one: one warm-up
optimizer step on zero gradients, then forward, backward and the optimizer step,
the batch, checkpointing and kernels as ``profile --fake`` has them.

A deep model's step is one period of its layers traced and repeated
(``periodic``), checked against a trace a period deeper, as the flat step is: the
engines' per-layer work (an FSDP2 unit's all-gather and reduce-scatter, DDP's
gradient copies) repeats with the layers. Where the check fails, the whole model is
traced. What does not repeat with the layers is written for the whole model after
the repetition: DDP's buckets (``ddp_engine``). The process group is made at the
world size and rank asked; FSDP2's step at other world sizes and ranks is then the
same events with other sizes (``rank_sizes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..engine.idioms import apply_checkpointing
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.train_step import make_optimizer, optimizer_tensors
from ..errors import YafsdpError
from ..sources.adapted import adapt, keeps_stored_base
from .fake import entered, fake_errors, make_fake_mode
from .micro_batches import MicroTrace
from .modules import module_names, tracking_layers, tracking_modules
from .positions import index_errors
from .precision import Masters
from .profile_options import ProfileOptions
from .profiler import (
    _assign_roles,
    _batch,
    _layers,
    _optimizer_impl,
    _own_layers,
    _rounding,
    _Run,
    _step_modes,
    _Traced,
    _tracked_step,
    build_module,
    steps_at_depth,
    warm_up,
)
from .shard_sizes import RecordedStep
from .tracker import StorageTracker, op_tensors

VARIANT = "engine"  # the one variant an engine's run traces


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """The default process group as rank ``rank`` of ``world_size`` fake ranks."""
    if dist.is_initialized():
        raise YafsdpError(
            "plan --scheme runs FSDP2 and DDP under a fake process group of its own; "
            "torch.distributed is already initialized in this process: plan from a "
            "process of its own"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclasses.dataclass(frozen=True, slots=True)
class Unwrapped:
    """No engine: the original model as one GPU trains it (its 16-bit parameters with
    float32 masters, as the profiler's original step), the step a training stack runs
    on a single rank (torchtitan applies FSDP and DDP only to more than one)."""

    def cast(self, module: nn.Module, opts, keep_frozen: bool) -> None:
        from .precision import cast_params

        cast_params(module, opts.step.param_dtype, keep_frozen=keep_frozen)

    def wrap(self, module: nn.Module, layout, opts, modes) -> _Alone:
        return _Alone(module)

    def finish(self, step, loaded, opts, got, ran: dict):
        return step


class _Alone:
    masters = True

    def __init__(self, module: nn.Module):
        self.forward, self.params = module, list(module.parameters())

    def before(self, tracker, opt) -> None:
        pass

    def tracking(self, tracker):
        return contextlib.nullcontext()

    def sizes(self, tracker):
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class EngineTracker(StorageTracker):
    """The profiler's tracker for an engine's step: a ``DTensor``'s bytes are its
    local tensor's (its wrapper holds none); ``ignore``d storages are never counted
    (DDP's buckets, written for the whole model afterwards); ``sizes``, where an
    engine names its blocks by world size and rank (``fsdp2_engine.Fsdp2Sizes``),
    sees each op's fresh outputs."""

    def __init__(self, round_bytes: int = 1):
        super().__init__(round_bytes)
        self.sizes = None
        self._skip: set[int] = set()  # ids of ignored storages' blocks
        self._ignoring = False
        # the layer what is made now belongs to, whichever layer runs (an FSDP2 unit's
        # collectives run in its neighbour's region when prefetched); None: the region's
        self.making_for: int | None = None

    @staticmethod
    def _storage(t: torch.Tensor):
        return _local(t).untyped_storage()

    def ignore(self, tensors) -> None:
        self._ignoring = True
        try:
            for t in tensors:
                self._skip.add(self.block(t))
        finally:
            self._ignoring = False

    def _see(self, st, owner=None) -> int:
        new = st not in self._index
        if self._ignoring and new:
            self._skip.add(len(self._size))
        i = super()._see(st, owner)
        if new and self.making_for is not None:
            self._owner[i] = self.making_for
        return i

    def _resize(self, i: int, nbytes: int) -> None:
        if i not in self._skip:
            super()._resize(i, nbytes)

    def record(self, args, kwargs, out) -> None:
        outs = [_local(t) for t in _tensors(out)]
        fresh = [t for t in outs if self.is_new(t)] if self.sizes is not None else ()
        super().record(args, kwargs, out)
        if fresh:
            self.sizes.made(fresh, args, kwargs, outs, self.phase)


def _tensors(out) -> list[torch.Tensor]:
    return op_tensors(out if isinstance(out, (list, tuple)) else (out,))


@dataclasses.dataclass
class EngineStep:
    """An engine's step at the model's depth, how it was had (``periodic``), the batch
    it ran on and how it was checkpointed; ``traced``: the step as traced, of ``depth``
    layers (the short model's; None: the whole model)."""

    step: RecordedStep
    how: object  # periodic.PeriodicTrace
    batch: str
    ckpt_note: str
    traced: RecordedStep
    depth: int | None
    # the step is what it should be on its own: repeated where the check held, or
    # traced whole where that was the plan (not because a check failed)
    sound: bool = True


def traced_step(loaded, opts: ProfileOptions, engine, rank: int, depth: int | None):
    """The step of ``engine`` on rank ``rank`` traced at ``depth`` layers of the model's
    stack (None: the whole model), not repeated: what ``EngineStep.traced`` is, at
    another world size or rank."""
    from .layer_stack import find_stack

    loaded = adapt(loaded, opts.step)
    stack = find_stack(loaded.module) if depth is not None else None
    with fake_errors(True):
        run, _ = _run(loaded, opts, make_fake_mode(), engine, rank, stack, depth)
    return run.traced[VARIANT].step


def engine_step(
    loaded, opts: ProfileOptions, engine, rank: int = 0, checked: bool = True
) -> EngineStep:
    """The fake step of ``engine`` (``fsdp2_engine.Fsdp2Engine``, ``ddp_engine.
    DdpEngine``) on rank ``rank`` of ``opts.layout.world_size``, at the model's depth
    (see the note); ``checked`` False: one period repeated without a trace a period
    deeper (the caller checks it against a step that had one)."""
    from .layer_stack import find_stack
    from .profiler import _whole_why

    loaded = adapt(loaded, opts.step)
    fake_mode = make_fake_mode()
    ran: dict[int | None, object] = {}  # depth traced (None: whole) -> the engine's model

    def run(loaded, opts, fake_mode, variants, progress, stack=None, depth=None):
        done, ran[depth] = _run(loaded, opts, fake_mode, engine, rank, stack, depth)
        return done

    with fake_errors(True):
        got = steps_at_depth(
            loaded, opts, fake_mode, (VARIANT,), lambda *_: None, run, checked=checked
        )
        step = engine.finish(got.steps[VARIANT], loaded, opts, got, ran)
    traced = got.run.traced[VARIANT].step
    depth = got.how.traced_layers[0] if got.how.periodic else None
    planned_whole = _whole_why(find_stack(loaded.module), opts) is not None
    return EngineStep(
        step, got.how, got.run.batch.describe(), got.run.ckpt_note, traced, depth,
        sound=got.how.periodic or planned_whole,
    )  # fmt: skip


def _run(loaded, opts: ProfileOptions, fake_mode, engine, rank, stack, depth):
    """Build the model (``depth`` layers of ``stack`` where given), wrap it in the
    engine on a fake process group, and track one step: the ``_Run`` and the engine's
    model."""
    with entered(fake_mode):
        module = build_module(loaded, opts, fake_mode, stack, depth)
    engine.cast(module, opts, keeps_stored_base(loaded))  # a LoRA base keeps its dtype
    module.train()
    layout = plan(spec_from_module(module), opts.layout)
    ckpt_note = apply_checkpointing(module, opts.step.checkpointing, layout.blocks)
    batch = _batch(module, opts)
    _, modes = _step_modes(opts, fake_mode)
    layers = _layers(module, stack) if stack is not None else None
    with fake_process_group(opts.layout.world_size, rank):
        wrapped = engine.wrap(module, layout, opts, modes)
        with entered(*modes), index_errors(module, opts):
            traced = _trace(wrapped, module, batch, opts, layers)
    return _Run({VARIANT: traced}, layout, ckpt_note, batch, {}, module), wrapped


def _trace(wrapped, module: nn.Module, batch, opts: ProfileOptions, layers) -> _Traced:
    """One step of ``wrapped`` (the engine around ``module``), tracked (see
    ``profiler._trace_step``: the same roles, layers and phases)."""
    params = wrapped.params
    masters = Masters(module, params, opts.step.grad_dtype) if wrapped.masters else None
    stepped = masters.stepped if masters else params
    opt = make_optimizer(opts.step.optimizer, stepped, _optimizer_impl(opts))
    warm_up(opt, stepped)
    tracker = EngineTracker(_rounding(opts))
    wrapped.before(tracker, opt)
    _assign_roles(tracker, module, params, opt, batch)
    if masters is not None:
        tracker.assign(masters.masters(), "optimizer")
    if layers is not None:
        tracker.layer_of = {name: i for i, (name, _) in layers.items()}
        _own_layers(tracker, layers, None, masters, opt)
    names = module_names(module, opts)
    start = time.perf_counter()
    layers_told = tracking_layers(tracker, layers or {}, first=True)
    with tracker, tracking_modules(tracker, names), layers_told:
        with wrapped.tracking(tracker):
            _tracked_step(
                tracker,
                wrapped.forward,
                params,
                batch,
                opt,
                opts,
                None,
                masters,
                opts.step.grad_accum,
            )
        tracker.assign(optimizer_tensors(opt), "optimizer")
    wall = time.perf_counter() - start
    step = RecordedStep(tracker.recorded(), None, wrapped.sizes(tracker))
    if tracker.owner_clash:
        step = dataclasses.replace(step, events=dataclasses.replace(step.events, owners=None))
    count = opts.step.grad_accum  # every micro-batch traced, gradient sync on in each
    return _Traced(step, wall, None, MicroTrace(count, count, False, ""))
