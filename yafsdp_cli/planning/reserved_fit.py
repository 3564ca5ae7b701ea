"""Will a cell fit as the GPU decides: the caching allocator's reserved peak plus the
memory beside the allocator, under the job's allocator setting or another.

Each cell's fake step hands its allocation trace to the allocator's model
(``memory.caching_allocator.reserved_of``) under the job's own setting
(``--alloc-conf``, else ``PYTORCH_CUDA_ALLOC_CONF``); and, where the cell does not fit
under it but its allocated peak would, under the same with
``expandable_segments:True``, the setting a plan may advise. A cell's
*fragmentation* is its reserved peak minus its allocated peak: every cell's comes
from its own replay. Fragmentation is not smooth in the micro-batch (a block that no
later request fits comes and goes with the sizes) and may grow with it (Llama-2-70B,
checkpointed, 4096 tokens: 1 GiB at micro-batch 1, 12 GiB at 8), so no cell's is
taken from another's.

Beside the allocator (``memory.outside_allocator``): the CUDA context, cuBLAS and
cuBLASLt workspaces and NCCL's buffers for the cell's world size, each overridable
(``--outside``), or one sum for all of them (``--reserve``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable

import torch

from ..memory import headroom
from ..memory.caching_allocator import reserved_of
from ..memory.outside_allocator import OutsideAllocator, OutsidePart, outside_memory
from ..options.alloc_conf import ALLOC_CONF_VAR, AllocatorConf, allocator_setting
from .cell import Cell
from .plan_report import AllocAdvice

RESERVED = "reserved:"  # a run's figures: RESERVED + setting -> its reserved peak


def plan_confs(opts) -> tuple[AllocatorConf, ...]:
    """The job's allocator setting and, unless it has them, the same with expandable
    segments; none for ``--target cpu`` (no caching allocator to model)."""
    if opts.step.kernels != "cuda":
        return ()
    own = allocator_setting(opts.memory.alloc_conf)
    if own.expandable_segments:
        return (own,)
    return own, dataclasses.replace(own, expandable_segments=True)


def may_advise(opts, cell: Cell, reserved: int, allocated: int) -> bool:
    """Whether another allocator setting could change ``cell``'s verdict: it does not
    fit with ``reserved`` under the job's setting, and it would with its ``allocated``
    peak (no setting reserves less than the step allocates)."""
    outside = outside_at(opts, cell.world_size).total
    gpu, margin = opts.memory.gpu_memory, opts.memory.margin_bytes
    return (
        not headroom.fit(reserved, outside, gpu, margin).fits
        and headroom.fit(allocated, outside, gpu, margin).fits
    )


def replayed(trace, confs) -> dict[str, int]:
    """A run's reserved peak under each setting, keyed ``RESERVED + setting``."""
    return {RESERVED + str(c): reserved_of(trace, c).reserved_peak for c in confs}


def outside_at(opts, world_size: int) -> OutsideAllocator:
    """What a rank of ``world_size`` holds beside the allocator: ``--reserve`` as one
    part, else the itemised parts for the installed torch on a Hopper GPU (the
    measured one), the environment's variables and ``--outside``'s overrides."""
    if opts.memory.reserve is not None:
        return OutsideAllocator((OutsidePart("reserve", opts.memory.reserve, "--reserve, given"),))
    return outside_memory(
        torch_version=torch.__version__,
        world_size=world_size,
        env=os.environ,
        **dict(opts.memory.outside),
    )


def export_line(conf: AllocatorConf) -> str:
    return f"export {ALLOC_CONF_VAR}={shlex.quote(str(conf))}"


class ReservedFit:
    """The reserved and outside figures of the cells of one plan. ``figures(cell)``:
    the cell's measured figures (``measure.Runner.figures``)."""

    def __init__(self, opts, figures: Callable):
        self.opts, self.figures = opts, figures
        self.confs = plan_confs(opts)
        self.gpu = opts.memory.gpu_memory
        self.margin = opts.memory.margin_bytes
        self._outside: dict[int, OutsideAllocator] = {}

    @property
    def alloc_conf(self) -> str | None:
        return str(self.confs[0]) if self.confs else None

    def outside(self, world_size: int) -> OutsideAllocator:
        if world_size not in self._outside:
            self._outside[world_size] = outside_at(self.opts, world_size)
        return self._outside[world_size]

    def fields(self, cell: Cell) -> dict:
        """A ``PlanRow``'s allocated, reserved, outside and fit fields for ``cell``."""
        return self.fields_of(self.figures(cell), cell)

    def fields_of(self, figures: dict[str, int], cell: Cell) -> dict:
        """``fields`` of a run's ``figures`` at ``cell`` (another step's than the
        plan's: an engine's, one rank's)."""
        peak = top_phase(figures)[1]
        outside = self.outside(cell.world_size)
        reserved = figures[RESERVED + str(self.confs[0])] if self.confs else peak
        here = headroom.fit(reserved, outside.total, self.gpu, self.margin)
        advice = None
        other = figures.get(RESERVED + str(self.confs[1])) if len(self.confs) > 1 else None
        if not here.fits and other is not None:
            there = headroom.fit(other, outside.total, self.gpu, self.margin)
            if there.fits:
                conf = self.confs[1]
                advice = AllocAdvice(str(conf), export_line(conf), other, there.needed, there)
        return dict(
            peak_bytes=peak,
            reserved_bytes=reserved,
            fragmentation_bytes=reserved - peak,
            outside=outside.parts,
            needed_bytes=here.needed,
            fits=here.fits,
            fits_with=advice,
            fit=here,
        )

    def reserved(self, cell: Cell) -> int:
        """The cell's reserved peak under the plan's setting (its allocated peak where
        no caching allocator is modelled: ``--target cpu``)."""
        figures = self.figures(cell)
        if not self.confs:
            return top_phase(figures)[1]
        return figures[RESERVED + str(self.confs[0])]

    def fragmentation(self, cell: Cell) -> int:
        return self.reserved(cell) - top_phase(self.figures(cell))[1]


def top_phase(figures: dict[str, int]) -> tuple[str, int]:
    """A run's highest phase and its peak (the phase peaks alone: other figures are
    named ``kind:...``)."""
    return max(((k, v) for k, v in figures.items() if ":" not in k), key=lambda kv: kv[1])


def keeping_margin(rows) -> list:
    """The rows (``PlanRow`` or ``SchemeRow``) that fit keeping the plan's margin free
    (their ``Fit``): the candidates for a best row."""
    return [r for r in rows if r.fit.keeps_margin]


def advised(rows) -> list:
    """The rows that fit keeping the margin free under the advised allocator setting."""
    return [r for r in rows if r.fits_with is not None and r.fits_with.fit.keeps_margin]
