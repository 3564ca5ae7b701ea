"""The per-rank memory model: per-parameter (DDP) training against flat buffers.

All figures are bytes held by one rank. Every tensor allocation is rounded up to
``round_bytes`` (512 by default: the CUDA caching allocator's granularity), so the
baseline pays that per parameter, gradient and optimizer state, while flat buffers
pay it once per buffer. Assumptions, stated in every report:

- trainable parameters have a gradient (``grad_dtype``, default the parameter's);
- optimizer states: ``adamw``/``adam`` two per element, ``sgd`` one (momentum),
  ``none`` zero; they are float32 when master weights are kept, else in the
  parameter's dtype (what ``torch.optim`` does);
- master weights: a float32 copy of each trainable non-float32 parameter, on by
  default ("auto") when parameters are 16-bit;
- DDP's gradient buckets are not counted (as with ``gradient_as_bucket_view=True``);
- module buffers (BatchNorm statistics, rotary tables) are replicated everywhere;
- flat scheme: each rank keeps ``1/world_size`` of every flat buffer, its gradient,
  optimizer states and master weights; unconverted parameters stay whole. While a
  unit computes, two all-gather buffers and two gradient buffers the size of the
  largest unit exist (current and prefetched unit, as YaFSDP preallocates them);
  none are needed at world size 1.

Reference schemes: ``zero2`` (gradients, states, master sharded; parameters
whole), ``zero3`` (everything sharded evenly, no padding; one all-gather buffer
and one unsharded gradient buffer the size of the largest unit), and ``fsdp``:
what PyTorch FSDP2's ``fully_shard`` allocates on its fullest rank, parameter by
parameter (see ``fsdp2`` and its note; checked against real FSDP2 on gloo).

Not counted anywhere: activations, temporaries, the optimizer's per-tensor
``step`` counters (0-d, on the CPU unless ``fused``/``capturable``), communication
library workspaces and allocator fragmentation beyond the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import dtypes
from ..engine.layout import Layout, round_up
from ..schemes import DDP, FLAT, ZERO2, ZERO3
from .config import (
    OPTIMIZER_STATES,
    MemoryBreakdown,
    MemoryConfig,
    Optimizer,
    TensorSize,
    add_parts,
    buffer_bytes,
    tensors_of_layout,
    whole_bytes,
)
from .fsdp2 import Fsdp2Memory, fsdp2_memory

GATHER_BUFFERS = 2  # current unit + prefetched next unit
REDUCE_BUFFERS = 2  # current unit + the one whose reduce-scatter is in flight

__all__ = ["MemoryBreakdown", "MemoryConfig", "MemoryReport", "Optimizer", "estimate_memory"]


@dataclass(frozen=True, slots=True)
class MemoryReport:
    config: MemoryConfig
    world_size: int
    baseline: MemoryBreakdown  # ddp
    flat: MemoryBreakdown  # yafsdp, the layout given
    references: tuple[MemoryBreakdown, ...]  # zero2, zero3, fsdp (FSDP2's fullest rank)
    largest_unit: str  # "" is the root unit
    largest_unit_bytes: int  # its parameters, all dtypes, padded
    fsdp2: Fsdp2Memory  # the fsdp column rank by rank, and the uneven-split warning

    @property
    def savings_bytes(self) -> int:
        return self.baseline.total - self.flat.total

    @property
    def savings_percent(self) -> float:
        return 100.0 * self.savings_bytes / self.baseline.total if self.baseline.total else 0.0


def _sharded_buffer(numel: int, dtype: str, trainable: bool, cfg: MemoryConfig, with_params=True):
    """One rank's share of one flat buffer of ``numel`` (already divided) elements."""
    r = cfg.round_bytes
    out = dict(params=0, grads=0, optimizer=0, master=0)
    if with_params:
        out["params"] = round_up(numel * dtypes.itemsize(dtype), r)
    if trainable:
        out["grads"] = round_up(numel * cfg.grad_itemsize(dtype), r)
        out["optimizer"] = OPTIMIZER_STATES[cfg.optimizer] * round_up(
            numel * cfg.state_itemsize(dtype), r
        )
        if cfg.master_for(dtype):
            out["master"] = round_up(numel * 4, r)
    return out


def _unit_bytes(layout: Layout, cfg: MemoryConfig, grads: bool) -> dict[str, int]:
    """Unsharded bytes of each unit's buffers (parameters, or their gradients)."""
    out: dict[str, int] = {}
    for b in layout.buffers:
        if grads and not b.requires_grad:
            continue
        size = cfg.grad_itemsize(b.dtype) if grads else dtypes.itemsize(b.dtype)
        out[b.unit] = out.get(b.unit, 0) + b.padded_numel * size
    return out


def estimate_memory(
    layout: Layout, cfg: MemoryConfig | None = None, *, fsdp_placement: str = "dim0"
) -> MemoryReport:
    """Per-rank bytes for DDP, the flat layout, and ZeRO-2/ZeRO-3/FSDP2 references.

    The ``fsdp`` reference is FSDP2's fullest rank (``fsdp2.fsdp2_memory``) with
    ``fsdp_placement`` ``"dim0"`` (what ``fully_shard`` does by default) or
    ``"auto"`` (``Shard(1)`` where dim 0 splits badly).
    """
    cfg = cfg or MemoryConfig()
    n = layout.world_size
    converted, kept, bufs = tensors_of_layout(layout)
    buffers = buffer_bytes(bufs, cfg)
    ddp = MemoryBreakdown(
        DDP, **whole_bytes(converted + kept, cfg), buffers=buffers, gather=0, reduce=0
    )
    flat = _flat_scheme(FLAT, layout, kept, cfg, buffers, GATHER_BUFFERS, REDUCE_BUFFERS)
    fsdp = fsdp2_memory(layout, cfg, fsdp_placement)
    unit_params = _unit_bytes(layout, cfg, grads=False)
    largest = max(unit_params, key=unit_params.get) if unit_params else ""
    largest_grads = max(_unit_bytes(layout, cfg, grads=True).values(), default=0)
    refs = (
        _zero2(converted, kept, cfg, buffers, n),
        _zero3(converted, kept, cfg, buffers, n, unit_params.get(largest, 0), largest_grads),
        fsdp.fullest,
    )
    return MemoryReport(cfg, n, ddp, flat, refs, largest, unit_params.get(largest, 0), fsdp)


def _flat_scheme(name, layout, kept, cfg, buffers, n_gather, n_reduce) -> MemoryBreakdown:
    parts = [_sharded_buffer(b.shard_numel, b.dtype, b.requires_grad, cfg) for b in layout.buffers]
    whole = whole_bytes(kept, cfg)
    gather = reduce = 0
    if layout.world_size > 1:
        params, grads = _unit_bytes(layout, cfg, False), _unit_bytes(layout, cfg, True)
        gather = n_gather * max(params.values(), default=0)
        reduce = n_reduce * max(grads.values(), default=0)
    return MemoryBreakdown(
        name, **add_parts(*parts, whole), buffers=buffers, gather=gather, reduce=reduce
    )


def _zero2(converted, kept, cfg, buffers, n) -> MemoryBreakdown:
    """Parameters whole; gradients, optimizer states and master weights sharded."""
    params = whole_bytes([TensorSize(t.numel, t.dtype, False) for t in converted], cfg)
    shards = [
        _by_dtype_shard(converted, dtype, n, cfg, with_params=False) for dtype in _dtypes(converted)
    ]
    return MemoryBreakdown(
        ZERO2,
        **add_parts(params, *shards, whole_bytes(kept, cfg)),
        buffers=buffers,
        gather=0,
        reduce=0,
    )


def _zero3(converted, kept, cfg, buffers, n, largest_unit, largest_grads) -> MemoryBreakdown:
    """Everything sharded evenly (no alignment); the largest unit gathered once and its
    gradients held unsharded once, until their reduce-scatter."""
    shards = [_by_dtype_shard(converted, dtype, n, cfg) for dtype in _dtypes(converted)]
    gather, reduce = (largest_unit, largest_grads) if n > 1 else (0, 0)
    return MemoryBreakdown(
        ZERO3,
        **add_parts(*shards, whole_bytes(kept, cfg)),
        buffers=buffers,
        gather=gather,
        reduce=reduce,
    )


def _dtypes(tensors: list[TensorSize]) -> list[str]:
    return list(dict.fromkeys(t.dtype for t in tensors))


def _by_dtype_shard(tensors, dtype, n, cfg, with_params=True) -> dict[str, int]:
    trainable = sum(t.numel for t in tensors if t.dtype == dtype and t.trainable)
    frozen = sum(t.numel for t in tensors if t.dtype == dtype and not t.trainable)
    parts = [_sharded_buffer(-(-trainable // n), dtype, True, cfg, with_params)]
    if frozen and with_params:
        parts.append(_sharded_buffer(-(-frozen // n), dtype, False, cfg))
    return add_parts(*parts)


def assumptions(report: MemoryReport) -> tuple[str, ...]:
    """The memory model's assumptions for ``report``, as sentences for the user."""
    cfg = report.config
    states = OPTIMIZER_STATES[cfg.optimizer]
    grad = f"in {cfg.grad_dtype}" if cfg.grad_dtype else "in each parameter's dtype"
    if cfg.master_weights is False:
        master = "master weights: off; optimizer states in the parameters' dtype"
    else:
        which = "16-bit" if cfg.master_weights is None else "non-float32"
        auto = " (auto)" if cfg.master_weights is None else ""
        master = (
            f"master weights{auto}: a float32 copy of every trainable {which} parameter, "
            "whose optimizer states are then float32 too"
        )
    rounding = (
        "figures are exact storage bytes per rank, no allocator rounding (--round-bytes 1)"
        if cfg.round_bytes == 1
        else f"figures are bytes per rank; every tensor allocation is rounded up to "
        f"{cfg.round_bytes} bytes (CUDA caching allocator), so per-parameter schemes pay "
        "it per tensor and flat buffers once per buffer"
    )
    lines = [
        rounding,
        f"gradients {grad}, one per trainable parameter",
        f"optimizer {cfg.optimizer}: {states} state(s) per trainable element",
        master,
        "module buffers (BatchNorm statistics, rotary tables) are replicated on every rank",
        "ddp: gradient buckets are not counted (as with gradient_as_bucket_view=True)",
    ]
    lines += _sharding_assumptions(report)
    lines.append(
        "not counted: activations, temporaries, optimizer step counters (one 4-byte "
        "tensor per parameter, on the host unless fused or capturable), communication "
        "workspaces, fragmentation beyond the rounding"
    )
    return tuple(lines)


def _sharding_assumptions(report: MemoryReport) -> list[str]:
    if report.world_size == 1:
        return ["world size 1: nothing is sharded, gathered or reduce-scattered"]
    unit = report.largest_unit or "the root unit"
    return [
        f"yafsdp: each rank keeps 1/{report.world_size} of every flat buffer, its gradient, "
        f"optimizer states and master weights; unconverted parameters stay whole; "
        f"{GATHER_BUFFERS} all-gather and {REDUCE_BUFFERS} gradient buffers the size of the "
        f"largest unit ({unit}) exist while units compute",
        "zero2 and zero3 are reference estimates: zero2 shards gradients and "
        "optimizer states, parameters whole; zero3 shards everything evenly and holds one "
        "gathered unit and its gradients",
        _fsdp_assumption(report),
    ]


def _fsdp_assumption(report: MemoryReport) -> str:
    placement = (
        "Shard(1) where dim 0 splits more than 5% unevenly and dim 1 evenly (--fsdp-placement "
        "auto), else Shard(0)"
        if report.fsdp2.placement == "auto"
        else "Shard(0) (fully_shard's default)"
    )
    return (
        f"fsdp is FSDP2's fullest rank: fully_shard on every unit and the root, each "
        f"parameter cut by torch.chunk on {placement}; parameter and gradient storage "
        "padded to the largest chunk on every rank, optimizer states on the rank's own rows; "
        "with master weights the shards stay float32 (MixedPrecisionPolicy gathers the "
        "training dtype) and no other copy is kept; gathered: the root unit (not resharded "
        "after forward) and two of the largest other unit; one reduce-scatter input; "
        "parameters the filters leave out stay whole (as fully_shard's ignored_params)"
    )
