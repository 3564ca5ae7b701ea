"""The collectives of one step under each scheme, the bytes a rank sends, their ring time.

Per scheme (what each ``schemes.Scheme``'s ``collectives`` says: whether units'
parameters are all-gathered, how gradients are reduced, what one collective is), in
the order a rank issues them (``collectives``); this module takes a scheme or its
``timing_key``, the name the plan's JSON records:

- ``flat`` (``yafsdp``: the flat layout, as ``engine.sharded`` runs it): forward, an
  all-gather of every flat buffer, unit by unit (the root unit's first); backward,
  units in reverse, an all-gather again of every buffer of a non-root unit (resharded
  after forward; the root stays gathered) and a reduce-scatter of every trainable
  buffer's gradient, in the buffer's dtype (the runtime reduces in the parameter
  dtype); last, an all-reduce of each unconverted trainable parameter's gradient.
  A collective's size is the buffer's padded bytes;
- ``fsdp2`` (``fully_shard`` per unit and the root, as ``memory.fsdp2`` places it):
  one all-gather per unit of its parameters padded to ``torch.chunk``'s largest
  chunk times the world size, in the training dtype, in forward and again in
  backward for every unit but the root (not resharded after forward); one
  reduce-scatter per unit in the gradient dtype (``MemoryConfig.grad_dtype``,
  else the training dtype); unconverted parameters as for ``flat``;
- ``ddp``: one all-reduce per unit's gradients, in the gradient dtype, in backward
  (DDP's buckets are about a unit's size in a large model; their count only moves
  the latency term).

A ring collective over ``n`` ranks of a tensor of ``B`` bytes sends ``(n - 1)`` chunks
of ``B / n`` from each rank: ``(n - 1) / n * B`` for an all-gather or reduce-scatter,
twice that for an all-reduce (a reduce-scatter then an all-gather). Chunks are
rounded up to whole bytes where ``n`` does not divide ``B`` (never for flat buffers,
whose padded sizes ``n`` divides). Its time::

    t = (n - 1) / n * B / bandwidth + (n - 1) * latency        (all-reduce: twice)

with the intra-node link's bandwidth and latency while ``n`` fits on one node
(``GpuSpec.gpus_per_node``), and the inter-node bandwidth per GPU and latency
beyond (a ring that leaves the node runs at its slowest hop). Not modelled: NCCL's
tree algorithms at large ``n``, SHARP, contention with other jobs, the copies into
and out of the communication buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..engine import dtypes
from ..engine.layout import Layout
from ..engine.units import ROOT
from ..errors import YafsdpError
from ..memory.config import MemoryConfig
from ..memory.fsdp2 import place
from ..schemes import Collectives, Scheme, timed
from .gpu_specs import GpuSpec

Kind = Literal["all_gather", "reduce_scatter", "all_reduce"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """What links the GPUs beyond one GPU's own figures."""

    inter_node_bytes_per_s: float = 50e9  # one 400 Gb/s NIC per GPU (InfiniBand NDR)
    intra_latency_s: float = 5e-6  # one ring step over NVLink, NCCL's order of magnitude
    inter_latency_s: float = 10e-6  # one ring step through a NIC and a switch

    def __post_init__(self) -> None:
        if self.inter_node_bytes_per_s <= 0:
            raise YafsdpError(
                f"inter-node bandwidth must be positive, got {self.inter_node_bytes_per_s}"
            )
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise YafsdpError("collective latencies must be 0 or more seconds")


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a rank takes part in."""

    kind: Kind
    unit: str  # "" is the root unit
    phase: str  # forward | backward
    bytes: int  # the whole tensor: gathered, or reduced
    sent: int  # what this rank sends in a ring of world_size


def check_scheme(scheme: Scheme | str) -> Scheme:
    """A scheme the step-time model has collectives for, given as itself or by its
    ``timing_key``."""
    known = timed()
    found = (
        scheme
        if isinstance(scheme, Scheme)
        else next((s for s in known if s.timing_key == scheme), None)
    )
    if found is None or found.collectives is None:
        given = scheme.name if isinstance(scheme, Scheme) else scheme
        keys = "|".join(str(s.timing_key) for s in known)
        raise YafsdpError(f"scheme {given!r} is not one of {keys}")
    return found


def ring_sent(kind: str, nbytes: int, n: int) -> int:
    """Bytes one rank sends in a ring collective of ``nbytes`` over ``n`` ranks."""
    chunk = -(-nbytes // n)
    steps = (n - 1) * (2 if kind == "all_reduce" else 1)
    return steps * chunk


def ring_time(kind: str, nbytes: int, n: int, gpu: GpuSpec, cluster: Cluster) -> float:
    """Seconds for one collective over ``n`` ranks (see the module docstring): a ring
    over the intra-node link while ``n`` fits on a node, else hierarchical."""
    if n == 1:
        return 0.0
    passes = 2 if kind == "all_reduce" else 1
    g = gpu.gpus_per_node
    if n <= g:
        return passes * (
            (n - 1) / n * nbytes / gpu.link_bytes_per_s + (n - 1) * cluster.intra_latency_s
        )
    nodes = -(-n // g)
    inter = min(gpu.link_bytes_per_s, cluster.inter_node_bytes_per_s)
    across = (nodes - 1) / n * nbytes / inter + (nodes - 1) * cluster.inter_latency_s
    within = (g - 1) / g * nbytes / gpu.link_bytes_per_s + (g - 1) * cluster.intra_latency_s
    return passes * (across + within)


def unit_order(layout: Layout) -> list[str]:
    """Units in forward order: the root first, then as their buffers appear."""
    order = [ROOT]
    for b in layout.buffers:
        if b.unit not in order:
            order.append(b.unit)
    return order


def collectives(
    layout: Layout, scheme: Scheme | str, cfg: MemoryConfig | None = None, placement: str = "dim0"
) -> tuple[Collective, ...]:
    """Every collective of one step for one rank of ``layout.world_size``, in issue
    order; none at world size 1."""
    cfg = cfg or MemoryConfig()
    n = layout.world_size
    if n == 1:
        return ()
    how = check_scheme(scheme).collectives
    sizes = _sizes(layout, how, cfg, placement)
    out: list[Collective] = []
    order = unit_order(layout)

    def add(kind, unit, phase, nbytes):
        if nbytes:
            out.append(Collective(kind, unit, phase, nbytes, ring_sent(kind, nbytes, n)))

    if how.gathers_params:
        for unit in order:
            for nbytes in sizes["gather"].get(unit, []):
                add("all_gather", unit, "forward", nbytes)
    for unit in reversed(order):
        if how.gathers_params and unit != ROOT:
            for nbytes in sizes["gather"].get(unit, []):
                add("all_gather", unit, "backward", nbytes)
        for nbytes in sizes["reduce"].get(unit, []):
            add(how.reduces, unit, "backward", nbytes)
    for nbytes in sizes["kept"]:
        add("all_reduce", ROOT, "backward", nbytes)
    return tuple(out)


def _sizes(layout: Layout, how: Collectives, cfg: MemoryConfig, placement: str) -> dict:
    """unit -> collective sizes for gathers and reductions; kept gradients' sizes."""
    gather: dict[str, list[int]] = {}
    reduce: dict[str, list[int]] = {}
    if how.sized_by == "buffers":
        for b in layout.buffers:
            gather.setdefault(b.unit, []).append(b.nbytes)
            if b.requires_grad:
                reduce.setdefault(b.unit, []).append(b.nbytes)
    elif how.sized_by == "placement":
        n = layout.world_size
        g: dict[str, int] = {}
        r: dict[str, int] = {}
        for p in place(layout, cfg, placement):
            g[p.unit] = g.get(p.unit, 0) + p.split.padded * n * dtypes.itemsize(p.dtype)
            if p.trainable:
                size = p.split.padded * n * cfg.grad_itemsize(p.dtype)
                r[p.unit] = r.get(p.unit, 0) + size
        gather = {u: [v] for u, v in g.items()}
        reduce = {u: [v] for u, v in r.items()}
    else:
        for b in layout.buffers:
            if b.requires_grad:
                size = sum(e.numel for e in b.entries) * cfg.grad_itemsize(b.dtype)
                reduce[b.unit] = [reduce.get(b.unit, [0])[0] + size]
    kept = [
        t.numel * cfg.grad_itemsize(t.dtype)
        for t in layout.kept
        if t.is_param and t.requires_grad and t.floating
    ]
    if how.reduces == "all_reduce" and kept:  # bucketed with the root's gradients
        reduce[ROOT] = [reduce.get(ROOT, [0])[0] + sum(kept)]
        kept = []
    return {"gather": gather, "reduce": reduce, "kept": kept}


def sent_bytes(found) -> int:
    """What one rank sends over a step's collectives."""
    return sum(c.sent for c in found)
