"""The memory model's inputs and the per-tensor accounting every scheme shares.

``MemoryConfig`` is what the user chose (optimizer, gradient dtype, master weights,
allocator rounding); ``MemoryBreakdown`` is one rank's bytes under one scheme;
``whole_bytes`` is what tensors cost when each is allocated on its own (DDP, and
the parameters a scheme keeps unsharded). ``estimate`` (DDP, flat, ZeRO) and
``fsdp2`` (FSDP2's per-parameter placement) build on these.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..engine import dtypes
from ..engine.choices import check_optimizer
from ..engine.layout import Layout, round_up
from ..numbers import MAX_ROUND_BYTES
from ..options import MemoryOptions, StepOptions, check_at_least
from ..schemes import Scheme

Optimizer = Literal["adamw", "adam", "sgd", "none"]
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
PARTS = ("params", "grads", "optimizer", "master")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    grad_dtype: str | None = None  # None: each parameter's dtype
    optimizer: Optimizer = "adamw"
    master_weights: bool | None = None  # None: auto, on for 16-bit parameters
    round_bytes: int = 512

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        if self.grad_dtype is not None:
            object.__setattr__(self, "grad_dtype", dtypes.canonical(self.grad_dtype))
        check_at_least("round-bytes", self.round_bytes, maximum=MAX_ROUND_BYTES)

    def master_for(self, dtype: str) -> bool:
        if dtype == "float32" or not dtypes.is_floating(dtype):
            return False
        if self.master_weights is None:
            return dtypes.itemsize(dtype) <= 2
        return self.master_weights

    def state_itemsize(self, dtype: str) -> int:
        return 4 if self.master_for(dtype) else dtypes.itemsize(dtype)

    def grad_itemsize(self, dtype: str) -> int:
        return dtypes.itemsize(self.grad_dtype or dtype)

    @property
    def states(self) -> int:
        """Optimizer states per trainable element."""
        return OPTIMIZER_STATES[self.optimizer]

    def rounded(self, nbytes: int) -> int:
        """One allocation of ``nbytes`` as the allocator hands it out (0 stays 0)."""
        return round_up(nbytes, self.round_bytes)


def memory_config(
    step: StepOptions, memory: MemoryOptions, *, optimizer: str | None = None
) -> MemoryConfig:
    """The memory model's configuration from the options' step and memory pieces;
    ``optimizer`` stands in where the step leaves it open (``None``: a checkpoint's
    own). Rounding is the memory piece's rule for the step's kernels
    (``MemoryOptions.rounding``)."""
    return MemoryConfig(
        grad_dtype=step.grad_dtype,
        optimizer=step.optimizer or optimizer or "adamw",
        master_weights=memory.master_weights,
        round_bytes=memory.rounding(step.kernels),
    )


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes one rank holds under one scheme."""

    scheme: Scheme
    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int
    gather: int  # transient: all-gathered parameters of the units in flight
    reduce: int  # transient: unsharded gradients awaiting reduce-scatter

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.optimizer + self.master + self.buffers

    @property
    def total(self) -> int:
        return self.persistent + self.gather + self.reduce


@dataclass(frozen=True, slots=True)
class TensorSize:
    numel: int
    dtype: str
    trainable: bool


def tensors_of_layout(
    layout: Layout,
) -> tuple[list[TensorSize], list[TensorSize], list[TensorSize]]:
    """(converted params, kept params, module buffers) as plain sizes."""
    converted = [
        TensorSize(e.numel, e.dtype, b.requires_grad) for b in layout.buffers for e in b.entries
    ]
    kept = [
        TensorSize(t.numel, t.dtype, t.requires_grad and t.floating)
        for t in layout.kept
        if t.is_param
    ]
    bufs = [TensorSize(t.numel, t.dtype, False) for t in layout.kept if not t.is_param]
    return converted, kept, bufs


def whole_bytes(tensors: Iterable[TensorSize], cfg: MemoryConfig) -> dict[str, int]:
    """Per-tensor allocations (DDP): each parameter, gradient and state on its own."""
    out = dict.fromkeys(PARTS, 0)
    for t in tensors:
        out["params"] += cfg.rounded(t.numel * dtypes.itemsize(t.dtype))
        if not t.trainable:
            continue
        out["grads"] += cfg.rounded(t.numel * cfg.grad_itemsize(t.dtype))
        out["optimizer"] += cfg.states * cfg.rounded(t.numel * cfg.state_itemsize(t.dtype))
        if cfg.master_for(t.dtype):
            out["master"] += cfg.rounded(t.numel * 4)
    return out


def buffer_bytes(buffers: Iterable[TensorSize], cfg: MemoryConfig) -> int:
    """Module buffers, replicated on every rank."""
    return sum(cfg.rounded(t.numel * dtypes.itemsize(t.dtype)) for t in buffers)


def add_parts(*parts: dict[str, int]) -> dict[str, int]:
    return {k: sum(p.get(k, 0) for p in parts) for k in PARTS}
