"""Profile one training step of the original and of the converted model.

``profile_model`` builds the model (real, or fake: every parameter and buffer
replaced by a FakeTensor of the same shape and dtype, so a model that does not fit
costs no memory), takes one warm-up optimizer step on zero gradients so the
optimizer state exists (the steady state every later step sees), then tracks one
step: forward and loss, backward, optimizer step and ``zero_grad``. Then it converts
the same module in place and does the same again; with ``world_size > 1`` the
converted model runs as rank 0 of that many (``sharded.ShardedFlat`` with
``LocalComm``): shards persist, each unit's buffers are gathered while it runs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.flat import convert_module
from ..engine.idioms import apply_checkpointing
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.sharded import LocalComm, ShardedFlat
from ..engine.step import (
    Batch,
    check_optimizer,
    make_batch,
    make_optimizer,
    optimizer_tensors,
    run_forward,
    step_loss,
)
from ..errors import YafsdpError
from .fake import _fake_errors, _fake_mode, fake_copy
from .precision import Masters, cast_params, check_training_dtypes
from .tracker import Breakdown, ModuleMemory, PhaseSeries, StorageTracker

SCHEMA = "yafsdp.profile/1"
CHECKPOINTING = ("none", "units")
# progress(stage, done, total): called as each stage starts (for a progress bar)
STAGES = ("building the model", "original step", "converting", "converted step")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    filters: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    units: tuple[str, ...] | None = None
    world_size: int = 1
    align: str = "yafsdp"
    batch: int = 2
    seq_len: int = 16
    input_shape: tuple[int, ...] | None = None
    seed: int = 0
    fake: bool = False
    per_module: bool = False
    depth: int = 3  # per-module rows: module names with at most this many parts
    device: str = "cpu"
    param_dtype: str | None = None  # training dtype of floating parameters; None: as stored
    grad_dtype: str | None = None  # None: the parameter's dtype
    checkpointing: str = "none"  # none | units (non-reentrant, every unit)
    round_bytes: int | None = None  # None: 512 on cuda (the caching allocator), else 1

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer, self.optimizer_impl)
        check_training_dtypes(self.param_dtype, self.grad_dtype)
        if self.checkpointing not in CHECKPOINTING:
            raise YafsdpError(
                f"--checkpointing {self.checkpointing!r} is not one of {'|'.join(CHECKPOINTING)}"
            )
        if self.round_bytes is not None and self.round_bytes < 1:
            raise YafsdpError(f"--round-bytes must be at least 1, got {self.round_bytes}")
        for name in ("world_size", "batch", "seq_len", "depth"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise YafsdpError(f"--{flag} must be at least 1, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise YafsdpError(f"--device {self.device!r} is not cpu or cuda")


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """``torch.cuda`` peaks over the tracked step (only with a GPU)."""

    allocated_peak: int
    reserved_peak: int


@dataclass(frozen=True, slots=True)
class StepProfile:
    variant: str  # "original" or "converted"
    peak: Breakdown  # bytes alive at the step's peak, by category
    peak_phase: str  # forward | backward | optimizer
    phase_peaks: dict[str, int]  # the highest total in each phase
    end: Breakdown  # alive after zero_grad: what the next step starts from
    modules: tuple[ModuleMemory, ...]
    cuda: CudaMemory | None
    ops: int
    wall_s: float
    series: tuple[PhaseSeries, ...] = ()  # bytes alive through each phase, for charts


@dataclass(frozen=True, slots=True)
class ProfileReport:
    source: str
    fake: bool
    device: str
    world_size: int  # the converted model runs as rank 0 of this many
    optimizer: str
    optimizer_impl: str
    inputs: str  # e.g. "input_ids (1, 4096) int64"
    round_bytes: int  # every storage rounded up to this (CUDA's allocator: 512)
    flat_buffers: int
    converted: int
    kept: int
    original: StepProfile
    converted_step: StepProfile
    notes: tuple[str, ...] = ()

    @property
    def saving_bytes(self) -> int:
        return self.original.peak.total - self.converted_step.peak.total


def profile_source(
    source, *, model=None, trust_pickle=False, opts=None, progress=None
) -> ProfileReport:
    from ..sources import load_source

    loaded = load_source(source, model=model, trust_pickle=trust_pickle)
    return profile_model(loaded, opts or ProfileOptions(), progress=progress)


def profile_model(loaded, opts: ProfileOptions | None = None, progress=None) -> ProfileReport:
    """Profile ``loaded`` (``sources.load_source``): original, then converted."""
    opts = opts or ProfileOptions()
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise YafsdpError("--device cuda: no CUDA device is available; use --device cpu")
    fake_mode = _fake_mode() if opts.fake else None
    with _fake_errors(opts.fake):
        return _profile(loaded, opts, fake_mode, progress or (lambda *_: None))


def profile_converted(loaded, opts: ProfileOptions) -> StepProfile:
    """The converted model's step alone (what ``plan`` measures), no original step."""
    fake_mode = _fake_mode() if opts.fake else None
    with _fake_errors(opts.fake):
        with _entered(fake_mode):
            module, layout = _prepared(loaded, opts, fake_mode)
        batch = _batch(module, opts, fake_mode)
        with _entered(fake_mode):
            return _converted(module, layout, batch, opts)


def _prepared(loaded, opts: ProfileOptions, fake_mode):
    """The module in its training dtype with its layout, units checkpointed if asked
    (on this one model: it is converted in place, never copied)."""
    module = build_module(loaded, opts, fake_mode)
    cast_params(module, opts.param_dtype)
    module.train()
    layout = plan(
        spec_from_module(module),
        filters=opts.filters,
        excludes=opts.excludes,
        units=opts.units,
        world_size=opts.world_size,
        align=opts.align,
    )
    if opts.checkpointing == "units":
        apply_checkpointing(module, "non-reentrant", layout.units)
    return module, layout


def _rounding(opts: ProfileOptions) -> int:
    if opts.round_bytes is not None:
        return opts.round_bytes
    return 512 if opts.device == "cuda" else 1


def _converted(module, layout, batch, opts: ProfileOptions) -> StepProfile:
    flat = convert_module(module, layout)
    sharded = None
    if opts.world_size > 1:
        sharded = ShardedFlat(flat, LocalComm(0, opts.world_size))
    params = sharded.parameters() if sharded else flat.parameters()
    return _profile_step("converted", module, params, batch, opts, _rounding(opts), sharded)


def _profile(loaded, opts: ProfileOptions, fake_mode, progress) -> ProfileReport:
    progress(STAGES[0], 0, len(STAGES))
    with _entered(fake_mode):
        module, layout = _prepared(loaded, opts, fake_mode)
    batch = _batch(module, opts, fake_mode)
    with _entered(fake_mode):
        progress(STAGES[1], 1, len(STAGES))
        params = list(module.parameters())
        original = _profile_step("original", module, params, batch, opts, _rounding(opts))
        progress(STAGES[2], 2, len(STAGES))
        progress(STAGES[3], 3, len(STAGES))
        converted = _converted(module, layout, batch, opts)
    progress("done", len(STAGES), len(STAGES))
    return ProfileReport(
        source=loaded.spec.source,
        fake=opts.fake,
        device=opts.device,
        world_size=opts.world_size,
        optimizer=opts.optimizer,
        optimizer_impl=opts.optimizer_impl,
        inputs=batch.describe(),
        round_bytes=_rounding(opts),
        flat_buffers=len(layout.buffers),
        converted=sum(len(b.entries) for b in layout.buffers),
        kept=sum(1 for t in layout.kept if t.is_param),
        original=original,
        converted_step=converted,
        notes=_notes(opts),
    )


@contextlib.contextmanager
def _entered(mode):
    if mode is None:
        yield
    else:
        with mode:
            yield


def build_module(loaded, opts: ProfileOptions, fake_mode) -> nn.Module:
    """A real module with the weights, or a fake one that holds no memory."""
    if fake_mode is None:
        module = loaded.build_module()
        return module.to("cuda") if opts.device == "cuda" else module
    if loaded.module is None:
        loaded.build_module()  # raises: profiling needs an architecture
    return fake_copy(loaded.module, loaded.spec, opts.device)


def _batch(module: nn.Module, opts: ProfileOptions, fake_mode) -> Batch:
    batch = make_batch(
        module,
        batch=opts.batch,
        seq_len=opts.seq_len,
        seed=opts.seed,
        input_shape=opts.input_shape,
    )
    if opts.device == "cuda":
        batch = batch.map(lambda t: t.to("cuda"))
    if fake_mode is not None:
        batch = batch.map(fake_mode.from_tensor)
    return batch


def _warm_up(opt, params: list[nn.Parameter]) -> None:
    """One step on zero gradients: the optimizer state of a steady-state step."""
    if opt is None:
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _profile_step(variant, module, params, batch, opts, rounding, sharded=None) -> StepProfile:
    masters = Masters(module, params, opts.grad_dtype) if opts.param_dtype else None
    stepped = masters.stepped if masters else params
    opt = make_optimizer(opts.optimizer, stepped, opts.optimizer_impl)
    _warm_up(opt, stepped)
    tracker = StorageTracker(rounding)
    _assign_roles(tracker, module, params, opt, batch)
    if masters is not None:
        tracker.assign(masters.masters(), "optimizer")  # float32 masters: optimizer-owned
    if sharded is not None:
        sharded.on_grad_buffer = lambda g: tracker.assign(g, "gradients")
    names = _module_names(module, opts) if opts.per_module else {}
    cuda_before = _cuda_reset(opts.device)
    start = time.perf_counter()
    with tracker, _tracking_modules(tracker, names):
        _tracked_step(tracker, module, params, batch, opt, opts, sharded, masters)
    wall = time.perf_counter() - start
    timeline = tracker.replay(list(dict.fromkeys(names.values())))
    return StepProfile(
        variant=variant,
        peak=timeline.peak,
        peak_phase=timeline.peak_phase,
        phase_peaks=timeline.phase_peaks,
        end=timeline.end,
        modules=timeline.modules,
        cuda=_cuda_peaks(opts.device, cuda_before),
        ops=timeline.ops,
        wall_s=wall,
        series=timeline.series,
    )


def _assign_roles(tracker, module, params, opt, batch) -> None:
    tracker.assign([*params, *module.parameters()], "parameters")
    tracker.assign(list(module.buffers()), "buffers")
    tracker.assign(optimizer_tensors(opt), "optimizer")
    tracker.assign(batch.tensors(), "activations")


def _tracked_step(tracker, module, params, batch, opt, opts, sharded, masters) -> None:
    tracker.set_phase("forward")
    torch.manual_seed(opts.seed)
    loss = step_loss(run_forward(module, batch), opts.seed)
    tracker.set_phase("backward")
    loss.backward()
    del loss
    if sharded is not None:
        sharded.finish_backward()
    if masters is not None:
        masters.after_backward()
        tracker.assign(masters.grads(), "gradients")
    tracker.assign([p.grad for p in params if p.grad is not None], "gradients")
    tracker.assign([p.grad for p in module.parameters() if p.grad is not None], "gradients")
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


def _module_names(module: nn.Module, opts: ProfileOptions) -> dict[int, str]:
    out = {}
    for name, m in module.named_modules():
        if name and name.count(".") < opts.depth:
            out.setdefault(id(m), name)
    return out


@contextlib.contextmanager
def _tracking_modules(tracker: StorageTracker, names: dict[int, str]):
    if not names:
        yield
        return
    from torch.distributed._tools.mod_tracker import ModTracker

    def hook(backward: bool, enter: bool):
        def fn(mod, *_args):
            name = names.get(id(mod)) if mod is not None else None
            if name is not None:
                (tracker.enter_module if enter else tracker.exit_module)(name, backward)

        return fn

    mt = ModTracker()
    mt.register_user_hooks(
        hook(False, True), hook(False, False), hook(True, True), hook(True, False)
    )
    with mt:
        yield
    mt.clear_user_hooks()


def _cuda_reset(device: str):
    # Not testable on a machine without a GPU; guarded so it never runs there.
    if device != "cuda" or not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return True


def _cuda_peaks(device: str, started) -> CudaMemory | None:
    if started is None:
        return None
    torch.cuda.synchronize()
    return CudaMemory(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())


def _notes(opts: ProfileOptions) -> tuple[str, ...]:
    notes = [
        "one warm-up step on zero gradients first, so optimizer state exists as in every "
        "later step; bytes are the storages the step's tensors use, not the allocator's cache",
    ]
    if opts.fake:
        notes.append("fake tensors (FakeTensorMode): shapes and dtypes only, no memory used")
    if opts.param_dtype:
        notes.append(
            f"parameters in {opts.param_dtype}; 16-bit ones get float32 masters that the "
            "optimizer steps on (its states float32), counted as optimizer; gradients in "
            f"{opts.grad_dtype or opts.param_dtype}"
        )
    if opts.checkpointing == "units":
        notes.append("activation checkpointing (non-reentrant) of every unit, both models")
    if opts.world_size > 1:
        notes.append(
            f"converted: rank 0 of {opts.world_size}; persistent parameters, gradients and "
            "optimizer state are shards, each unit's buffers gathered while it runs; the "
            "original is one whole (DDP-like) replica"
        )
    return tuple(notes)
