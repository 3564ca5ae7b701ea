"""``inspect``'s first line: the flat layout beside the best other sharding scheme.

DDP shards nothing, so what the flat layout saves against it says little; the question
a reader brings is whether the flat layout needs less than ZeRO or FSDP2. It is asked
at the user's ``--world-size``, or, where that is 1 (nothing is sharded, every scheme
needs the same), at ``HEADLINE_WORLD_SIZE``: one node of eight GPUs, the smallest
machine most sharded runs use.

Where the flat layout needs more, the reason is its transient buffers: two all-gather
and two gradient buffers the size of its largest unit (``memory.estimate``), against
FSDP2's one reduce-scatter input and ZeRO-3's one of each. They grow with the largest
unit. The default units give an embedding and an untied head that outweigh a block
units of their own (``engine.units.split_units``), so Llama-3-8B's largest unit is
its embedding (1002 MiB), not the two together in the root unit (1.96 GiB). Where the
root unit is still the largest (units given with ``--unit``), the headline names the
modules in it that hold a block's bytes and the ``--unit`` globs that give them units
of their own, with what the flat layout needs so (Llama-3-8B at 8 ranks with the
blocks alone: 22.79 GiB, and 18.87 GiB with them split).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..engine.layout import Layout
from ..engine.plan import plan
from ..engine.records import ModelSpec
from ..engine.units import split_units
from ..errors import YafsdpError
from ..memory.config import MemoryConfig
from ..memory.estimate import MemoryBreakdown, MemoryReport, estimate_memory
from ..options import LayoutOptions
from ..schemes import DDP, FLAT, Scheme

HEADLINE_WORLD_SIZE = 8  # one node of 8 GPUs: where an unsharded (world size 1) run compares


@dataclass(frozen=True, slots=True)
class Headline:
    """The flat layout beside the best other sharding scheme, at ``world_size``."""

    world_size: int
    given: bool  # the user's --world-size; else HEADLINE_WORLD_SIZE (theirs was 1)
    schemes: tuple[MemoryBreakdown, ...]  # every scheme per rank there: ddp, flat, the others
    best: Scheme  # the other sharding scheme (not DDP, not flat) needing the least
    largest_unit: str  # the flat layout's largest unit there ("" is the root unit)
    largest_unit_bytes: int
    outside: tuple[str, ...]  # modules in the root unit, each as large as a block
    split_units: tuple[str, ...]  # --unit globs giving each of them a unit of its own
    split_flat: int | None  # the flat layout's bytes per rank with split_units

    def scheme(self, scheme: Scheme) -> MemoryBreakdown:
        return next(m for m in self.schemes if m.scheme is scheme)

    @property
    def flat_more(self) -> int:
        """What the flat layout needs beyond the best other scheme (negative: less)."""
        return self.scheme(FLAT).total - self.scheme(self.best).total


def headline(
    spec: ModelSpec,
    lay: LayoutOptions,
    cfg: MemoryConfig,
    placement: str,
    layout: Layout,
    memory: MemoryReport,
) -> Headline:
    """The comparison for ``inspect``'s first line (``layout`` and ``memory``: the
    report's own, reused where the user's world size is the one compared at)."""
    given = lay.world_size > 1
    n = lay.world_size if given else HEADLINE_WORLD_SIZE
    if not given:
        layout = plan(spec, dataclasses.replace(lay, world_size=n))
        memory = estimate_memory(layout, cfg, fsdp_placement=placement)
    schemes = (memory.baseline, memory.flat, *memory.references)
    others = [m for m in schemes if m.scheme not in (DDP, FLAT)]
    best = min(others, key=lambda m: m.total).scheme
    # the modules the default units would split out, where the units in use leave
    # them in the root unit
    outside = split_units(spec, layout.units)
    split = _split_units(layout, lay, outside)
    split_flat = _flat_with(spec, lay, cfg, placement, n, split) if split else None
    return Headline(
        n,
        given,
        schemes,
        best,
        memory.largest_unit,
        memory.largest_unit_bytes,
        outside if split_flat is not None else (),
        split if split_flat is not None else (),
        split_flat,
    )


def _split_units(layout: Layout, lay: LayoutOptions, outside: tuple[str, ...]) -> tuple[str, ...]:
    """``--unit`` globs for the blocks as they are and each module of ``outside``."""
    if not outside:
        return ()
    blocks = lay.units or tuple(re.sub(r"\.\d+$", ".*", u) for u in layout.units if u)
    return (*dict.fromkeys(blocks), *outside)


def _flat_with(spec, lay, cfg, placement, n: int, units: tuple[str, ...]) -> int | None:
    """The flat layout's bytes per rank at ``n`` ranks with ``units``; None where
    those globs do not plan (a module a name-only source cannot resolve)."""
    try:
        layout = plan(spec, dataclasses.replace(lay, units=units, world_size=n))
    except YafsdpError:
        return None
    return estimate_memory(layout, cfg, fsdp_placement=placement).flat.total
