"""``yafsdp verify``: does the converted model train exactly like the original?

The original module and a converted deep copy run the same seeded micro-batches
for ``steps`` optimizer steps of ``micro_batches`` accumulated micro-batches each
(so gradient accumulation, and its reset by ``zero_grad``, are exercised). After
every micro-batch the outputs are compared; after every step's backward passes
every gradient by name (every tied owner too: ``FlatModel.named_grads`` against the
original's ``named_parameters(remove_duplicate=False)``); after the optimizer step
every parameter and module buffer. Both sides use the same optimizer with
``foreach=False``; dropout is seeded identically before each forward.

Tolerance: a tensor passes when ``|converted - original| <= atol + rtol * |original|``
everywhere (NaNs in the same places). Defaults: exact (0, 0) for every dtype on
CPU, where the converted model runs the very same kernels on the same values, so
even bfloat16 is bit-exact; on CUDA, ``torch.testing.assert_close``'s defaults
(float32 1e-5/1.3e-6, bfloat16 1e-5/1.6e-2, float16 1e-5/1e-3), since kernels may
pick other algorithms for differently aligned parameter views. ``atol``/``rtol``
override them for every dtype.

A gradient that the original lacks (``None``: the parameter took no part in the
forward) and the flat buffer holds as zeros is accepted, with a note: torch's
optimizers skip the one and step the other (weight decay, momentum), which the
parameter comparison after the step then reports.

With ``world_size > 1`` the check runs on that many processes (``dist``):
each rank keeps one shard of every flat buffer (``sharded.ShardedFlat``) and the
gathered gradients and parameters must equal a single-process run of the original
over every rank's micro-batches, summed in rank order. Each rank's persistent
bytes are measured and set beside ``memory.estimate_memory``'s model of them.

>>> from yafsdp_cli.sources import load_source
>>> from yafsdp_cli.verify import VerifyOptions, verify_model
>>> loaded = load_source(None, model="sample_models.models:mlp")  # doctest: +SKIP
>>> verify_model(loaded, VerifyOptions(steps=2)).ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..engine.idioms import apply_checkpointing, compiled
from ..engine.layout import Layout, round_up
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.train_step import make_batch
from ..errors import YafsdpError
from ..memory.estimate import MemoryConfig, estimate_memory
from ..options import LayoutOptions, StepOptions, check_at_least
from .blocks import BlockChoice, blocked_source, build_with_blocks, parse_blocks
from .budget import Budget
from .compare import (  # noqa: F401 - the comparison is part of verify's API
    CUDA_TOLERANCE,
    KINDS,
    Recorder,
    TensorDiff,
    Tolerance,
    diff_tensors,
    resolve_tolerances,
)

MEMORY_TOLERANCE_PERCENT = 1.0


# both sides step with foreach=False
VERIFY_STEP = StepOptions(optimizer_impl="for-loop")


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyOptions:
    """What to run; every field has the CLI's default."""

    layout: LayoutOptions = LayoutOptions()
    step: StepOptions = VERIFY_STEP
    steps: int = 3
    micro_batches: int = 2
    atol: float | None = None
    rtol: float | None = None
    top: int = 10  # worst tensors to report
    compile: bool = False  # torch.compile both models
    blocks: str | None = None  # --blocks SPEC: build the model with these blocks only

    def __post_init__(self) -> None:
        check_at_least("steps", self.steps)
        check_at_least("micro-batches", self.micro_batches)
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise YafsdpError(f"--{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class HeldBytes:
    """Bytes one rank keeps between steps."""

    params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank held after its last optimizer step, beside the memory model."""

    rank: int
    measured: HeldBytes
    modeled: HeldBytes  # estimate_memory(...).flat, master weights off
    round_bytes: int  # allocation rounding applied to both sides
    diff_percent: float  # 100 * (measured - modeled) / modeled
    ok: bool  # within MEMORY_TOLERANCE_PERCENT


@dataclass(frozen=True, slots=True)
class VerifyReport:
    source: str
    ok: bool  # every comparison within tolerance (and memory within 1%)
    steps: int
    micro_batches: int  # per step and rank
    optimizer: str
    world_size: int
    device: str
    backend: str  # "" in one process, else gloo or nccl
    flat_buffers: int
    converted: int  # converted parameters (tied ones once)
    kept: int  # parameters left as they were
    compared: int  # tensor comparisons made
    failures: int  # comparisons out of tolerance
    tolerances: tuple[Tolerance, ...]
    worst: tuple[TensorDiff, ...]  # failing first, then the largest errors
    first_failure: TensorDiff | None  # the earliest comparison out of tolerance
    memory: tuple[RankMemory, ...]
    memory_ok: bool
    notes: tuple[str, ...] = ()
    budget: Budget | None = None  # the peak estimated before the run, and what was available
    blocks: BlockChoice | None = None  # None: every block of the model
    peak_rss: int = 0  # the most resident memory the run's processes held (the largest rank)
    pinned: str = ""  # the numerics both models ran under (``numerics.Pinned.describe``)
    # False: the original, re-run from the same start, did not reproduce its own numbers
    # (``drift`` is its first difference), so a mismatch proves nothing
    reproducible: bool = True
    drift: TensorDiff | None = None


# -- what a rank holds -----------------------------------------------------------------


def held_bytes(groups: Sequence[Iterable[torch.Tensor | None]], round_bytes: int) -> HeldBytes:
    """Bytes of the distinct storages in (params, grads, optimizer, buffers); a storage
    is counted once, in the first group that has it; each rounded to ``round_bytes``."""
    seen: set[int] = set()
    sums = []
    for tensors in groups:
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += round_up(st.nbytes(), round_bytes)
        sums.append(total)
    return HeldBytes(*sums)


def rank_memory(
    rank: int, held: HeldBytes, layout: Layout, optimizer: str, r: int, no_grad=frozenset()
) -> RankMemory:
    """``held`` beside the memory model of ``layout``; ``no_grad`` names unconverted
    parameters that never got a gradient (unused in forward), so hold no gradient and
    no optimizer state, which the model is told."""
    cfg = MemoryConfig(optimizer=optimizer, master_weights=False, round_bytes=r)
    if no_grad:
        kept = tuple(
            dataclasses.replace(t, requires_grad=False) if t.name in no_grad else t
            for t in layout.kept
        )
        layout = dataclasses.replace(layout, kept=kept)
    flat = estimate_memory(layout, cfg).flat
    modeled = HeldBytes(flat.params, flat.grads, flat.optimizer + flat.master, flat.buffers)
    diff = 100.0 * (held.total - modeled.total) / modeled.total if modeled.total else 0.0
    return RankMemory(rank, held, modeled, r, diff, abs(diff) <= MEMORY_TOLERANCE_PERCENT)


def allocation_rounding(device: str) -> int:
    """What one allocation really costs: CUDA's caching allocator rounds to 512 bytes;
    on the CPU a storage holds exactly its bytes."""
    return 512 if device == "cuda" else 1


# -- the check -------------------------------------------------------------------------


@dataclass(slots=True)
class Prepared:
    """The original module on its device and the layout to convert it with."""

    source: str
    original: nn.Module
    layout: Layout
    notes: list[str] = field(default_factory=list)


def prepare(loaded, opts: VerifyOptions, *, world_size: int | None = None) -> Prepared:
    """Build the original module (it needs an architecture; with ``opts.blocks``,
    those blocks only) and plan its layout."""
    if opts.blocks:
        blocked = blocked_source(loaded)
        module = build_with_blocks(loaded, blocked, parse_blocks(opts.blocks, blocked.total))
    else:
        module = loaded.build_module()
    if opts.step.device == "cuda":
        if not torch.cuda.is_available():
            raise YafsdpError("--device cuda: no CUDA device is available; use --device cpu")
        module = module.to("cuda")
    module.train()
    layout = plan_for(module, opts, world_size or opts.layout.world_size)
    if not layout.buffers:
        raise YafsdpError("the filters select no parameter to convert; nothing to verify")
    return Prepared(loaded.spec.source, module, layout)


def plan_for(module: nn.Module, opts: VerifyOptions, world_size: int) -> Layout:
    return plan(spec_from_module(module), replace(opts.layout, world_size=world_size))


def with_idioms(module: nn.Module, layout: Layout, opts: VerifyOptions):
    """Apply ``--checkpointing`` to ``module`` (one of the two models, after the deep
    copy) and return what runs its forward (``--compile``'s compiled module or itself)
    with what was done, in words. Run both inside ``numerics.pinned``."""
    done = apply_checkpointing(module, opts.step.checkpointing, layout.blocks)
    words = [f"activation checkpointing: {done} (both models)"] if done else []
    if opts.compile:
        words += ["torch.compile (inductor) of both models"]
        return compiled(module), words
    return module, words


def micro_seed(opts: VerifyOptions, step: int, micro: int, rank: int = 0) -> int:
    return opts.step.seed + 1_000_003 * step + 1009 * micro + 17 * rank


def batch_for(module: nn.Module, opts: VerifyOptions, seed: int):
    return make_batch(module, opts.step, seed=seed)


def unused_kept(kept) -> frozenset[str]:
    """Of ``kept`` (``FlatModel.kept_parameters()``: name, parameter), the trainable
    ones without a gradient (after a backward)."""
    return frozenset(n for n, p in kept if p.requires_grad and p.grad is None)


def named_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in module.named_parameters(remove_duplicate=False)}


def named_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}


def build_report(prep, opts, rec: Recorder, memory, *, backend: str, extra_notes=()):
    layout = prep.layout
    notes = [*prep.notes, *extra_notes]
    if rec.no_grad_zero:
        names = sorted(rec.no_grad_zero)
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        notes.append(
            f"{shown}: no gradient in the original (unused in forward), zeros in the flat "
            "buffer; torch's optimizers skip the one and step the other (--exclude them "
            "to compare the rest)"
        )
    memory = tuple(m for m in memory if m is not None)
    memory_ok = all(m.ok for m in memory)
    return VerifyReport(
        source=prep.source,
        ok=rec.failures == 0 and memory_ok,
        steps=opts.steps,
        micro_batches=opts.micro_batches,
        optimizer=opts.step.optimizer,
        world_size=layout.world_size,
        device=opts.step.device,
        backend=backend,
        flat_buffers=len(layout.buffers),
        converted=sum(len(b.entries) for b in layout.buffers),
        kept=sum(1 for t in layout.kept if t.is_param),
        compared=rec.compared,
        failures=rec.failures,
        tolerances=tuple(rec.tolerances.values()),
        worst=rec.ranked(opts.top),
        first_failure=rec.first_failure,
        memory=memory,
        memory_ok=memory_ok,
        notes=tuple(notes),
    )


def with_world_size(opts: VerifyOptions, world_size: int) -> VerifyOptions:
    return replace(opts, layout=replace(opts.layout, world_size=world_size))
