"""What one rank holds through a training step under each scheme, besides the
step's own activations and temporaries.

[Note: training schemes at the step's peak]
Each scheme is a ``MemoryBreakdown``: the persistent parts (``params``, ``grads``,
``optimizer``, ``master``, ``buffers``) and two transients, ``gather`` (parameters
all-gathered while units compute) and ``reduce`` (gradient communication buffers).
Nothing communicates at world size 1, so no scheme has transients there.

- ``flat``: the memory model's flat column (``estimate``): shards, two all-gather
  and two gradient buffers of the largest unit.
- ``fsdp2``: FSDP2's fullest rank (``fsdp2``): ``fully_shard`` on every unit and the
  root, float32 shards and the training dtype gathered under master weights
  (``MixedPrecisionPolicy(param_dtype=...)``), one reduce-scatter input in the
  gradient dtype (``reduce_dtype``). With ``reshard_after_forward=True`` (the
  default) the root stays gathered and two other units are in flight; with
  ``False`` every unit stays gathered from its forward to its backward, so the
  whole model is gathered at the start of backward.
- ``ddp``: everything whole, plus ``DistributedDataParallel``'s gradient buckets:
  with ``gradient_as_bucket_view=False`` (its default) they are a second copy of
  every gradient, cut into buckets of ``bucket_cap_mb=25`` (the first 1 MiB), one
  allocation each, made at construction and kept. (They are rebuilt once, at the
  second forward, in the order the gradients became ready; the old ones are freed
  first-come, while no gradient exists, so the rebuild never sets the peak.)
- ``zero1`` / ``zero2`` / ``zero3``: DeepSpeed ZeRO with its defaults
  (``DeepSpeedZeroConfig`` of deepspeed 0.19: ``reduce_bucket_size`` 5e8 and
  ``allgather_bucket_size`` 5e8 elements, ``contiguous_gradients`` on,
  ``overlap_comm`` on for stage 3 only, ``stage3_prefetch_bucket_size`` 5e7,
  ``stage3_param_persistence_threshold`` 1e5, ``stage3_max_live_parameters`` 1e9,
  ``stage3_max_reuse_distance`` 1e9).
  Optimizer states and float32 masters are partitioned in every stage. ZeRO-1
  keeps whole parameters and gradients; ZeRO-2 whole parameters and a
  ``1/world_size`` gradient partition; ZeRO-3 partitions parameters too, except
  those of at most ``param_persistence_threshold`` elements, which every rank keeps
  whole. With contiguous gradients every stage copies gradients into an
  "ipg" bucket of ``reduce_bucket_size`` elements in the gradient dtype, allocated
  whole (not capped by the model's size) and kept. ZeRO-3 gathers the unit that
  computes and prefetches up to ``prefetch_bucket_size`` elements of the next; a
  parameter the step reuses within ``max_reuse_distance`` elements is not released,
  so at the turn from forward to backward the last ``max_reuse_distance`` elements
  stay gathered (a whole model smaller than that); never more than
  ``max_live_parameters`` at once.

[Note: what each scheme holds at each phase's peak]
A scheme's peak is the highest phase of what it holds then plus the step's own bytes
then (``phase_peak``). The step's own bytes come from a fake run of the flat model
(the reference step: the plan's line at the world size, or at world size 1 for the
schemes that compute on whole parameters), as ``StepAt``: its activations and
temporaries beyond the model's bytes, plus what of those bytes it did not hold at that
moment (gather and gradient buffers not in use, gradients not yet made), so that its
own bytes stand free of the flat model's buffers. Then, at world sizes above 1:

- ``flat``, ``ddp`` and ``fsdp2`` resharding after forward hold what the reference
  holds at the same moments, in their own sizes: their bytes stand where the
  reference's model bytes stood (the flat model's buffers for FSDP2's root, units in
  flight and reduce-scatter input; the whole step's gradients for DDP, beside its
  buckets).
- ``fsdp2`` keeping every unit gathered: the shards and every gathered unit in
  forward (no gradient exists: ``zero_grad(set_to_none=True)``), plus one
  reduce-scatter input in backward; after backward every unit is resharded and
  the sharded gradients remain.
- ``zero1`` / ``zero2``: whole parameters and the partitioned optimizer states and
  masters throughout, and no gradient or bucket in forward: DeepSpeed allocates its
  buckets when the first gradient lands and frees them, with the partition's
  gradient buffer, once the step is over. Stage 2 reduces in the gradient hooks:
  each gradient is copied into the bucket and freed, those of the rank's partition
  into a ``1/world_size`` buffer. Stage 1 (``overlap_comm`` off) reduces after
  backward, so its gradients land whole first, as in the reference. So the backward
  holds the bucket and partition buffer only where the reference's backward peak
  has gradients already. The optimizer phase converts the partition's gradients to
  float32 and steps them: the reference step's gradients and optimizer temporaries,
  ``1/world_size`` of them.
- ``zero3``: its partitions, the whole persistent parameters, the partition's
  gradient buffer and the bucket throughout (all allocated once, at the engine's
  start), the gathered parameters in forward and backward, released after backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.layout import Layout
from ..errors import YafsdpError
from .config import MemoryBreakdown, MemoryConfig, TensorSize, tensors_of_layout, whole_bytes
from .estimate import MemoryReport, estimate_memory
from .fsdp2 import place

SCHEMES = ("flat", "fsdp2", "zero1", "zero2", "zero3", "ddp")
# schemes whose forward and backward run on whole parameters, as at world size 1
WHOLE_PARAMS = ("zero1", "zero2", "ddp")
MIB = 1024**2
DDP_FIRST_BUCKET = 1 * MIB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_CAP = 25 * MIB  # bucket_cap_mb=25


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """DeepSpeed's ZeRO settings, in elements (deepspeed 0.19's defaults)."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class SchemeSettings:
    """The knobs of the schemes that change a rank's bytes."""

    reshard_after_forward: bool = True  # FSDP2's fully_shard default
    ddp_bucket_view: bool = False  # DDP's gradient_as_bucket_view default
    zero: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)


def check_schemes(given: str | Sequence[str]) -> tuple[str, ...]:
    """``"fsdp2"``, ``("zero3", "flat")`` or ``"all"`` -> the schemes in ``SCHEMES``
    order, ``flat`` always among them; an unknown name raises."""
    parts = given.split(",") if isinstance(given, str) else given
    names = [s.strip().lower() for s in parts if s.strip()]
    text = ",".join(names)
    if names == ["all"]:
        return SCHEMES
    bad = [s for s in names if s not in SCHEMES]
    if bad or not names:
        raise YafsdpError(
            f"--scheme {text!r}: unknown scheme {', '.join(bad) or '(none)'}; "
            f"give a comma list of {', '.join(SCHEMES)}, or all"
        )
    # the flat scheme is the plan's own grid, and the others are compared against it
    return tuple(s for s in SCHEMES if s in names or s == "flat")


def scheme_memory(
    scheme: str,
    layout: Layout,
    cfg: MemoryConfig,
    settings: SchemeSettings | None = None,
    report: MemoryReport | None = None,
) -> MemoryBreakdown:
    """One rank's bytes under ``scheme`` at ``layout.world_size`` (see the note)."""
    settings = settings or SchemeSettings()
    report = report or estimate_memory(layout, cfg)
    n = layout.world_size
    converted, kept, _ = tensors_of_layout(layout)
    if scheme == "flat":
        return report.flat
    if scheme == "fsdp2":
        return _fsdp2(layout, cfg, settings, report)
    if scheme == "ddp":
        buckets = 0 if n == 1 or settings.ddp_bucket_view else ddp_buckets(converted + kept, cfg)
        return dataclasses.replace(report.baseline, reduce=buckets)
    if scheme in ("zero1", "zero2"):
        zero2 = report.references[0]
        ipg = 0 if n == 1 else ipg_bucket(converted + kept, cfg, settings.zero)
        out = dataclasses.replace(zero2, scheme=scheme, reduce=ipg)
        if scheme == "zero1":
            out = dataclasses.replace(out, grads=whole_bytes(converted + kept, cfg)["grads"])
        return out
    if scheme == "zero3":
        return _zero3(layout, cfg, settings.zero, report, converted + kept)
    raise ValueError(scheme)


def _fsdp2(layout, cfg, settings, report) -> MemoryBreakdown:
    fsdp = dataclasses.replace(report.fsdp2.fullest, scheme="fsdp2")
    n = layout.world_size
    if settings.reshard_after_forward or n == 1:
        return fsdp
    placed = place(layout, cfg, report.fsdp2.placement)
    every_unit = sum(p.split.padded * n * dtypes.itemsize(p.dtype) for p in placed)
    return dataclasses.replace(fsdp, gather=every_unit)


def ddp_buckets(tensors: list[TensorSize], cfg: MemoryConfig) -> int:
    """DDP's buckets: gradients in reverse order, one dtype per bucket, a bucket
    closed once it holds its cap (1 MiB for the first, 25 MiB after)."""
    total = 0
    open_: dict[str, int] = {}  # dtype -> bytes in its open bucket
    closed: dict[str, int] = {}  # dtype -> buckets closed so far
    for t in reversed([t for t in tensors if t.trainable]):
        dtype = cfg.grad_dtype or t.dtype
        open_[dtype] = open_.get(dtype, 0) + t.numel * dtypes.itemsize(dtype)
        cap = DDP_FIRST_BUCKET if closed.get(dtype, 0) == 0 else DDP_BUCKET_CAP
        if open_[dtype] >= cap:
            total += cfg.rounded(open_.pop(dtype))
            closed[dtype] = closed.get(dtype, 0) + 1
    return total + sum(cfg.rounded(b) for b in open_.values())


def ipg_bucket(tensors: list[TensorSize], cfg: MemoryConfig, zero: ZeroConfig) -> int:
    """ZeRO's contiguous-gradient bucket: ``reduce_bucket_size`` elements per
    gradient dtype, allocated whole."""
    grad_dtypes = {cfg.grad_dtype or t.dtype for t in tensors if t.trainable}
    return sum(cfg.rounded(zero.reduce_bucket_size * dtypes.itemsize(d)) for d in grad_dtypes)


def _zero3(layout, cfg, zero: ZeroConfig, report, tensors) -> MemoryBreakdown:
    base = dataclasses.replace(report.references[1], scheme="zero3")
    n = layout.world_size
    if n == 1:
        return dataclasses.replace(base, gather=0, reduce=0)
    small = [t for t in tensors if t.numel <= zero.param_persistence_threshold]
    large = [t for t in tensors if t.numel > zero.param_persistence_threshold]
    params = whole_bytes(small, cfg)["params"] + sum(
        cfg.rounded(-(-sum(t.numel for t in large if t.dtype == d) // n) * dtypes.itemsize(d))
        for d in dict.fromkeys(t.dtype for t in large)
    )
    units: dict[str, int] = {}
    itemsize = 0
    for b in layout.buffers:
        units[b.unit] = units.get(b.unit, 0) + b.numel
        itemsize = max(itemsize, dtypes.itemsize(b.dtype))
    largest = max(units.values(), default=0)
    computing = min(largest + min(zero.prefetch_bucket_size, largest), zero.max_live_parameters)
    # at the turn from forward to backward, what the backward reuses within
    # max_reuse_distance elements is not released (all of a small model)
    kept = min(sum(units.values()), zero.max_reuse_distance, zero.max_live_parameters)
    live = max(computing, kept)
    return dataclasses.replace(
        base, params=params, gather=live * itemsize, reduce=ipg_bucket(tensors, cfg, zero)
    )


@dataclass(frozen=True, slots=True)
class StepAt:
    """The reference step (a fake run's line) at one phase's peak: its activations,
    its temporaries beyond the model's bytes there, what of those model bytes it did
    not hold then (buffers not in use, gradients not yet made), and the gradients it
    held."""

    activations: int
    temporaries: int
    unheld: int
    grads: int

    @property
    def own(self) -> int:
        """The step's own bytes alive then: activations and temporaries."""
        return self.activations + self.temporaries + self.unheld


def phase_peak(
    scheme: str, phase: str, m: MemoryBreakdown, step: StepAt, world_size: int,
    settings: SchemeSettings,
) -> int:  # fmt: skip
    """One rank's bytes at ``phase``'s peak under ``scheme``: what it holds then
    (see the note on phases) plus the step's own bytes; ``m`` is
    ``scheme_memory``'s."""
    kept_gathered = scheme == "fsdp2" and not settings.reshard_after_forward
    if world_size == 1 or scheme in ("flat", "ddp") or (scheme == "fsdp2" and not kept_gathered):
        return m.total + step.activations + step.temporaries
    if scheme in ("zero1", "zero2"):
        return _zero12_at(scheme, phase, m, step, world_size)
    if scheme == "zero3":  # the gathered parameters are released after backward
        return m.total - (m.gather if phase == "optimizer" else 0) + step.own
    held = m.total - m.grads - m.reduce  # shards and every unit gathered, no gradient
    if phase == "backward":
        held += m.reduce
    elif phase == "optimizer":
        held += m.grads - m.gather
    return held + step.own


def _zero12_at(scheme: str, phase: str, m: MemoryBreakdown, step: StepAt, n: int) -> int:
    base = m.params + m.optimizer + m.master + m.buffers
    if phase == "forward":
        return base + step.own
    if phase == "optimizer":  # a partition's gradients made float32, and its step
        return base + step.activations + (step.own - step.activations + step.grads) // n
    landed = step.grads > 0  # the bucket and partition buffer come with the first
    if scheme == "zero1":  # reduced after backward: every gradient lands whole first
        return base + step.grads + (m.reduce if landed else 0) + step.own
    return base + ((m.reduce + m.grads) if landed else 0) + step.own
