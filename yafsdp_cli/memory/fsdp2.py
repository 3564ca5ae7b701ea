"""FSDP2's placement: what ``fully_shard`` allocates on each rank, parameter by parameter.

[Note: FSDP2 placement]
Read from torch 2.13 (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
``_fsdp_collectives.py``) and measured on gloo by ``tests/memory/test_fsdp2_truth.py``:

- A unit is one ``fully_shard`` call: each repeated block, and the root for the rest.
- Each parameter is cut on its shard dim ``k`` (``Shard(0)`` unless a
  ``shard_placement_fn`` says otherwise) by ``torch.chunk``: with ``d = shape[k]``
  and ``c = ceil(d / N)``, rank ``r`` owns ``clamp(d - r * c, 0, c)`` rows, so ranks
  ``[0, d // c)`` own ``c`` rows, rank ``d // c`` the remainder, later ranks none.
- Parameter storage: every rank allocates ``c`` rows (``chunks[0].size()``, "0th
  always padded"), zeros past its own rows; the local tensor is a view of it.
- Gradient storage: the reduce-scatter output, one tensor per unit holding ``c``
  rows of every trainable parameter (each ``.grad`` is a view into it), in the
  sharded parameter's dtype (cast back from ``reduce_dtype``).
- Optimizer states (``exp_avg``, ``exp_avg_sq``, SGD momentum): ``zeros_like`` the
  local shard, its own rows only, so ranks differ. ``step`` is one 0-d float32 tensor
  per parameter on the host (torch.optim unless fused/capturable): not counted.
- ``Shard(k)`` for ``k > 0`` needs ``shape[k] % N == 0`` (FSDP2 raises otherwise):
  every rank then holds exactly ``numel / N``, no padding.
- Mixed precision as ``MixedPrecisionPolicy`` does it: where the config keeps master
  weights (a 16-bit training dtype), the sharded parameters stay float32 (they are
  the master weights, nothing else is kept), so are their gradient shards and the
  optimizer states; the training dtype is what gets all-gathered. Without master
  weights everything is sharded in the training dtype. Frozen parameters are sharded
  in the training dtype.
- Transient, at the padded size (``c * N`` rows): the root unit's gathered parameters
  (the root is not resharded after forward, so they live through the whole step)
  and the largest other unit twice (current and prefetched), in the training dtype;
  one reduce-scatter input of the largest unit, in the gradient dtype.
- Allocator rounding: per parameter for parameters and states, per unit for
  gradients (one reduce-scatter output each).

Uneven splits: fused MoE experts ``(num_experts, ...)`` with fewer experts than ranks
put whole experts on the first ranks. ``auto`` placement gives ``Shard(1)`` to every
parameter whose dim-0 split leaves its fullest rank more than ``UNEVEN_PERCENT`` above
an even share and whose dim 1 divides evenly (torchtitan does the same for routed
experts when the FSDP degree exceeds the number of experts).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

from ..engine import dtypes
from ..engine.choices import PLACEMENTS, check_placement  # noqa: F401 - fsdp2's API
from ..engine.layout import Layout
from ..engine.units import ROOT
from ..schemes import FSDP2
from .config import (
    PARTS,
    MemoryBreakdown,
    MemoryConfig,
    add_parts,
    buffer_bytes,
    tensors_of_layout,
    whole_bytes,
)

Placement = Literal["dim0", "auto"]
UNEVEN_PERCENT = 5  # a split this much above an even share is worth a warning


@dataclass(frozen=True, slots=True)
class Split:
    """How one parameter's elements fall on the ranks: every rank allocates ``padded``;
    ranks ``[0, k)`` own ``full`` of them, rank ``k`` owns ``rest``, later ranks none."""

    padded: int
    full: int
    k: int
    rest: int


@dataclass(frozen=True, slots=True)
class PlacedParam:
    """One sharded parameter, where FSDP2 cuts it and how its elements fall."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the training dtype: what is all-gathered
    store: str  # the sharded storage dtype: float32 under mixed precision
    unit: str
    trainable: bool
    dim: int
    split: Split


@dataclass(frozen=True, slots=True)
class RankGroup:
    """Ranks ``ranks[0]`` to ``ranks[1]`` (inclusive) each hold these bytes."""

    ranks: tuple[int, int]
    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int
    persistent: int


@dataclass(frozen=True, slots=True)
class UnevenSplit:
    """FSDP2's default dim-0 split leaves the fullest rank well above an even split."""

    params: tuple[str, ...]  # globbed names of the parameters split unevenly
    fullest_rank: int
    fullest_bytes: int  # its persistent bytes with Shard(0) everywhere
    even_bytes: int  # persistent bytes per rank if every parameter split evenly
    excess_bytes: int  # fullest_bytes - even_bytes
    excess_percent: float
    dim1_params: tuple[str, ...]  # globbed names that split evenly on dim 1
    stuck_params: tuple[str, ...]  # uneven on dim 0, no even dim-1 split either
    dim1_bytes: int  # the fullest rank's persistent bytes with Shard(1) for dim1_params
    dim1_shapes: tuple[tuple[int, ...], ...]
    shard_placement_fn: str  # "" when no parameter can take Shard(1)


@dataclass(frozen=True, slots=True)
class Fsdp2Memory:
    placement: str  # "dim0" or "auto"
    fullest: MemoryBreakdown  # the fullest rank, transients included
    ranks: tuple[RankGroup, ...]  # distinct groups in rank order
    uneven: UnevenSplit | None  # None: the dim-0 split is within UNEVEN_PERCENT of even


def chunk_split(shape: Sequence[int], dim: int, world_size: int) -> Split:
    """``torch.chunk`` of ``shape`` on ``dim`` into ``world_size`` chunks, as FSDP2 pads it."""
    shape = tuple(shape) or (1,)  # a 0-d parameter is one row
    rows, numel = shape[dim], math.prod(shape)
    if numel == 0:
        return Split(0, 0, world_size, 0)
    per_row = numel // rows
    c = -(-rows // world_size)
    k = rows // c
    return Split(c * per_row, c * per_row, k, (rows - k * c) * per_row)


def even_split(shape: Sequence[int], world_size: int) -> Split:
    """Every rank owns and allocates an equal share (rounded up to whole elements)."""
    share = -(-math.prod(shape) // world_size)
    return Split(share, share, world_size, 0)


def uneven_on_dim0(shape: Sequence[int], world_size: int) -> bool:
    """The dim-0 split puts more than ``UNEVEN_PERCENT`` above an even share on rank 0."""
    rows = (tuple(shape) or (1,))[0]
    if rows == 0 or world_size == 1:
        return False
    padded_rows = -(-rows // world_size) * world_size
    return 100 * (padded_rows - rows) > UNEVEN_PERCENT * rows


def splits_on_dim1(shape: Sequence[int], world_size: int) -> bool:
    """FSDP2 accepts ``Shard(1)`` only where dim 1 divides evenly."""
    return len(shape) >= 2 and shape[1] > 0 and shape[1] % world_size == 0


def shard_dim(shape: Sequence[int], world_size: int, placement: str) -> int:
    """The dim FSDP2 cuts on: 0, or 1 under ``auto`` where that is the better split."""
    if placement == "auto" and uneven_on_dim0(shape, world_size):
        return 1 if splits_on_dim1(shape, world_size) else 0
    return 0


def place(layout: Layout, cfg: MemoryConfig, placement: str = "dim0") -> list[PlacedParam]:
    """Every converted parameter of ``layout`` as FSDP2 shards it, in model order."""
    n = layout.world_size
    out = []
    for b in layout.buffers:
        store = "float32" if b.requires_grad and cfg.master_for(b.dtype) else b.dtype
        for e in b.entries:
            dim = shard_dim(e.shape, n, placement)
            split = chunk_split(e.shape, dim, n)
            out.append(
                PlacedParam(e.name, e.shape, b.dtype, store, b.unit, b.requires_grad, dim, split)
            )
    return out


def _per_rank(placed: Iterable[PlacedParam], cfg: MemoryConfig, n: int):
    """(bytes every rank holds alike, optimizer bytes of each rank)."""
    same = dict.fromkeys(PARTS, 0)
    unit_grads: dict[tuple[str, str], int] = {}
    diff = [0] * (n + 1)  # optimizer bytes: diff[r] - diff[r - 1] summed from the left
    for p in placed:
        s, size = p.split, dtypes.itemsize(p.store)
        same["params"] += cfg.rounded(s.padded * size)
        if not p.trainable:
            continue
        key = (p.unit, p.store)
        unit_grads[key] = unit_grads.get(key, 0) + s.padded * size
        full = cfg.states * cfg.rounded(s.full * size)
        diff[0] += full
        diff[s.k] -= full
        if s.rest:  # rest > 0 only when k < n
            part = cfg.states * cfg.rounded(s.rest * size)
            diff[s.k] += part
            diff[s.k + 1] -= part
    same["grads"] = sum(cfg.rounded(nbytes) for nbytes in unit_grads.values())
    return same, list(accumulate(diff[:n]))


def _groups(layout: Layout, cfg: MemoryConfig, placed: list[PlacedParam]) -> list[RankGroup]:
    n = layout.world_size
    same, optimizer = _per_rank(placed, cfg, n)
    _, kept, bufs = tensors_of_layout(layout)
    whole = whole_bytes(kept, cfg)
    buffers = buffer_bytes(bufs, cfg)
    fixed = add_parts(same, whole)
    groups: list[RankGroup] = []
    for r, opt in enumerate(optimizer):
        if groups and groups[-1].optimizer == opt + fixed["optimizer"]:
            groups[-1] = _extend(groups[-1], r)
            continue
        parts = {**fixed, "optimizer": fixed["optimizer"] + opt}
        groups.append(
            RankGroup((r, r), **parts, buffers=buffers, persistent=sum(parts.values()) + buffers)
        )
    return groups


def _extend(g: RankGroup, last: int) -> RankGroup:
    return RankGroup(
        (g.ranks[0], last), g.params, g.grads, g.optimizer, g.master, g.buffers, g.persistent
    )


def _fullest(groups: Sequence[RankGroup]) -> RankGroup:
    return max(groups, key=lambda g: (g.persistent, -g.ranks[0]))


def rank_groups(
    layout: Layout, cfg: MemoryConfig | None = None, placement: str = "dim0"
) -> tuple[RankGroup, ...]:
    """What each rank holds under FSDP2, as distinct groups of ranks in rank order.

    >>> from yafsdp_cli import LayoutOptions, ModelSpec, TensorRecord, plan
    >>> spec = ModelSpec((TensorRecord("experts", (4, 8), "float32"),), has_architecture=False)
    >>> groups = rank_groups(plan(spec, LayoutOptions(world_size=8)), MemoryConfig(round_bytes=1))
    >>> [(g.ranks, g.params, g.optimizer) for g in groups]  # one expert row each on 0-3
    [((0, 3), 32, 64), ((4, 7), 32, 0)]
    """
    cfg = cfg or MemoryConfig()
    return tuple(_groups(layout, cfg, place(layout, cfg, check_placement(placement))))


def persistent_by_rank(
    layout: Layout, cfg: MemoryConfig | None = None, placement: str = "dim0"
) -> tuple[int, ...]:
    """Persistent bytes (parameters, gradients, optimizer states, module buffers) of
    every rank under FSDP2, rank 0 first; ``max()`` of it is the fullest rank's."""
    out: list[int] = []
    for g in rank_groups(layout, cfg, placement):
        out += [g.persistent] * (g.ranks[1] - g.ranks[0] + 1)
    return tuple(out)


def _transients(placed: Iterable[PlacedParam], cfg: MemoryConfig, n: int) -> tuple[int, int]:
    """(all-gathered parameters in flight, one reduce-scatter input), padded."""
    if n == 1:
        return 0, 0
    gathered: dict[str, int] = {}
    reduced: dict[str, int] = {}
    for p in placed:
        numel = p.split.padded * n
        gathered[p.unit] = gathered.get(p.unit, 0) + numel * dtypes.itemsize(p.dtype)
        if p.trainable:
            reduced[p.unit] = reduced.get(p.unit, 0) + numel * cfg.grad_itemsize(p.dtype)
    root = gathered.pop(ROOT, 0)
    largest = max(gathered.values(), default=0)
    return root + (2 if len(gathered) > 1 else 1) * largest, max(reduced.values(), default=0)


def fsdp2_memory(
    layout: Layout, cfg: MemoryConfig | None = None, placement: str = "dim0"
) -> Fsdp2Memory:
    """The ``fsdp`` scheme: FSDP2's fullest rank, every distinct rank group, and the
    uneven-split warning with its remedy."""
    cfg = cfg or MemoryConfig()
    placed = place(layout, cfg, check_placement(placement))
    groups = _groups(layout, cfg, placed)
    top = _fullest(groups)
    gather, reduce = _transients(placed, cfg, layout.world_size)
    fullest = MemoryBreakdown(
        FSDP2, top.params, top.grads, top.optimizer, top.master, top.buffers, gather, reduce
    )
    return Fsdp2Memory(placement, fullest, tuple(groups), uneven_split(layout, cfg))


def uneven_split(layout: Layout, cfg: MemoryConfig) -> UnevenSplit | None:
    """The warning and its remedy, or ``None`` where dim 0 splits about evenly."""
    n = layout.world_size
    dim0 = place(layout, cfg, "dim0")
    top = _fullest(_groups(layout, cfg, dim0))
    even = [_with_split(p, even_split(p.shape, n)) for p in dim0]
    even_bytes = _fullest(_groups(layout, cfg, even)).persistent
    if n == 1 or 100 * top.persistent <= (100 + UNEVEN_PERCENT) * even_bytes:
        return None
    uneven = [p for p in dim0 if uneven_on_dim0(p.shape, n)]
    movable = [p for p in uneven if splits_on_dim1(p.shape, n)]
    stuck = [p for p in uneven if not splits_on_dim1(p.shape, n)]
    auto = _fullest(_groups(layout, cfg, place(layout, cfg, "auto"))).persistent
    shapes = tuple(dict.fromkeys(p.shape for p in movable))
    return UnevenSplit(
        params=glob_names(p.name for p in uneven),
        fullest_rank=top.ranks[0],
        fullest_bytes=top.persistent,
        even_bytes=even_bytes,
        excess_bytes=top.persistent - even_bytes,
        excess_percent=100.0 * (top.persistent - even_bytes) / even_bytes if even_bytes else 0.0,
        dim1_params=glob_names(p.name for p in movable),
        stuck_params=glob_names(p.name for p in stuck),
        dim1_bytes=auto,
        dim1_shapes=shapes,
        shard_placement_fn=placement_fn_line(shapes),
    )


def _with_split(p: PlacedParam, split: Split) -> PlacedParam:
    return PlacedParam(p.name, p.shape, p.dtype, p.store, p.unit, p.trainable, p.dim, split)


def placement_fn_line(shapes: Sequence[tuple[int, ...]]) -> str:
    """The ``shard_placement_fn`` argument that gives ``shapes`` ``Shard(1)`` (the
    choice depends on the shape alone, so a shape test is exact)."""
    if not shapes:
        return ""
    listed = ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes)
    return f"shard_placement_fn=lambda p: Shard(1) if tuple(p.shape) in {{{listed}}} else None"


_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")  # a name component that is a number


def glob_names(names: Iterable[str]) -> tuple[str, ...]:
    """``model.layers.0.mlp.w``, ``model.layers.1.mlp.w`` -> ``model.layers.*.mlp.w``."""
    return tuple(dict.fromkeys(_NUMBER.sub("*", n) for n in names))
