"""What one rank holds through a training step under each scheme, besides the
step's own activations and temporaries: the parts the schemes' bytes are made of
(``SchemeParts``), each scheme's composition of them and its peak per phase being the
scheme's own (``yafsdp_cli.schemes``: one module per scheme, with its notes).

[Note: training schemes at the step's peak]
Each scheme is a ``MemoryBreakdown``: the persistent parts (``params``, ``grads``,
``optimizer``, ``master``, ``buffers``) and two transients, ``gather`` (parameters
all-gathered while units compute) and ``reduce`` (gradient communication buffers).
Nothing communicates at world size 1, so no scheme has transients there.

[Note: what each scheme holds at each phase's peak]
A scheme's peak is the highest phase of what it holds then plus the step's own bytes
then (``Scheme.phase_peak``). The step's own bytes come from a fake run of the flat
model (the reference step: the plan's cell itself, or the cell's micro-batch at world
size 1 for the schemes that compute on whole parameters), as ``StepAt``: its activations and
temporaries beyond the model's bytes, plus what of those bytes it did not hold at that
moment (gather and gradient buffers not in use, gradients not yet made), so that its
own bytes stand free of the flat model's buffers. At world sizes above 1 the flat
scheme, DDP and FSDP2 resharding after forward hold what the reference holds at the
same moments, in their own sizes: their bytes stand where the reference's model bytes
stood (the flat model's buffers for FSDP2's root, units in flight and reduce-scatter
input; the whole step's gradients for DDP, beside its buckets); the others say what
they hold phase by phase in their modules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.layout import Layout
from ..schemes import Scheme
from .config import MemoryBreakdown, MemoryConfig, TensorSize, tensors_of_layout, whole_bytes
from .estimate import MemoryReport, estimate_memory
from .fsdp2 import place

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


def scheme_memory(
    scheme: Scheme,
    layout: Layout,
    cfg: MemoryConfig,
    settings: SchemeSettings | None = None,
    report: MemoryReport | None = None,
) -> MemoryBreakdown:
    """One rank's bytes under ``scheme`` at ``layout.world_size`` (see the note)."""
    return scheme.memory(SchemeParts(layout, cfg, settings or SchemeSettings(), report))


class SchemeParts:
    """What the schemes' bytes are made of at one layout: the memory model's report
    and the parts a scheme's ``memory`` asks for, each computed when asked."""

    def __init__(
        self,
        layout: Layout,
        cfg: MemoryConfig,
        settings: SchemeSettings,
        report: MemoryReport | None = None,
    ) -> None:
        self.layout, self.cfg, self.settings = layout, cfg, settings
        self.report = report or estimate_memory(layout, cfg)
        self.world_size = layout.world_size
        converted, kept, _ = tensors_of_layout(layout)
        self.tensors = converted + kept

    def ddp_buckets(self) -> int:
        return ddp_buckets(self.tensors, self.cfg)

    def ipg_bucket(self) -> int:
        return ipg_bucket(self.tensors, self.cfg, self.settings.zero)

    def whole_grads(self) -> int:
        """Every gradient whole."""
        return whole_bytes(self.tensors, self.cfg)["grads"]

    def every_unit_gathered(self) -> int:
        """FSDP2's every unit gathered at once."""
        placed = place(self.layout, self.cfg, self.report.fsdp2.placement)
        n = self.world_size
        return sum(p.split.padded * n * dtypes.itemsize(p.dtype) for p in placed)

    def zero3(self, scheme: Scheme) -> MemoryBreakdown:
        """DeepSpeed's stage 3 (the scheme's note): the zero3 reference's shards with
        the small parameters whole, what stays gathered, and the ipg bucket."""
        return _zero3(self.layout, self.cfg, self.settings.zero, self.report, self.tensors, scheme)


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


def _zero3(layout, cfg, zero: ZeroConfig, report, tensors, scheme: Scheme) -> MemoryBreakdown:
    base = dataclasses.replace(report.references[1], scheme=scheme)
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
    """The reference step (the flat model's fake step) at one phase's peak: its activations,
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
