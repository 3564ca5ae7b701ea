"""Will a cell fit as the GPU decides: the caching allocator's reserved peak plus the
memory beside the allocator, under the job's allocator setting or another.

Each fake run of a plan hands its allocation trace to the allocator's model
(``memory.caching_allocator.reserved_of``), once per setting: the job's own
(``--alloc-conf``, else ``PYTORCH_CUDA_ALLOC_CONF``) and, unless it has them already,
the same with ``expandable_segments:True``, the setting a plan may advise. A run's
*fragmentation* is its reserved peak minus its allocated peak.

A cell with a run of its own takes that run's reserved peak. Any other cell carries
the largest fragmentation, in bytes, of the runs of its checkpointing choice at the
nearest micro-batch (by ratio; world size 1 apart from the sharded ones, whose state
fragments differently), its reserved peak rounded up to the 2 MiB segments come in.
Fragmentation is not smooth in the micro-batch (a block that no later request fits
comes and goes with the sizes) and may grow with it (Llama-2-70B, checkpointed, 4096
tokens: 1 GiB at micro-batch 1, 12 GiB at 8), so neither a ratio to the step's bytes
nor one figure for all micro-batches carries it well. Against each carried cell's own
replay (``python -m benchmarks.run plan_reserved``: Llama shapes of 2, 4 and 6
layers, world sizes 1-8, micro-batches 1-8, checkpointing on and off;
``tests/planning/test_reserved_fit.py`` on a tiny Llama) the carried reserved peak was 9.3%
under to 14.6% over, 1-3% on average. So the cells the answer rests on, the best row
and the advised one, are replayed from their own fake step before they are chosen
(``settle``), and the report lists how far the carried figure was from the replay
(``ReservedCheck``).

Beside the allocator (``memory.outside_allocator``): the CUDA context, cuBLAS and
cuBLASLt workspaces and NCCL's buffers for the cell's world size, each overridable
(``--outside``), or one sum for all of them (``--reserve``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from collections.abc import Callable

import torch

from ..memory import headroom
from ..memory.caching_allocator import reserved_of
from ..memory.outside_allocator import OutsideAllocator, OutsidePart, outside_memory
from ..options.alloc_conf import ALLOC_CONF_VAR, AllocatorConf, allocator_setting
from .cell import Cell
from .plan_report import AllocAdvice, PlanRow, ReservedCheck

RESERVED = "reserved:"  # a run's figures: RESERVED + setting -> its reserved peak
SEGMENT_STEP = 2 << 20  # the allocator takes memory from the driver in multiples of 2 MiB


def plan_confs(opts) -> tuple[AllocatorConf, ...]:
    """The job's allocator setting and, unless it has them, the same with expandable
    segments; none for ``--target cpu`` (no caching allocator to model)."""
    if opts.step.kernels != "cuda":
        return ()
    own = allocator_setting(opts.memory.alloc_conf)
    if own.expandable_segments:
        return (own,)
    return own, dataclasses.replace(own, expandable_segments=True)


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
    the run's figures when that run is made (None otherwise); ``model_total(ws)``:
    the memory model's persistent bytes."""

    def __init__(self, opts, figures: Callable, model_total: Callable, runs: Callable):
        self.opts, self.figures, self.model_total, self.runs = opts, figures, model_total, runs
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

    def fields(self, cell: Cell, peak: int) -> dict:
        """A ``PlanRow``'s reserved, outside and fit fields for ``cell`` at ``peak``
        allocated bytes."""
        outside = self.outside(cell.world_size)
        frags, replayed_here = self._fragmentation(cell, peak)
        reserved = peak + (frags[0] if frags else 0)
        here = headroom.fit(reserved, outside.total, self.gpu, self.margin)
        advice = None
        if not here.fits and len(frags) > 1:
            other = peak + frags[1]
            there = headroom.fit(other, outside.total, self.gpu, self.margin)
            if there.fits:
                conf = self.confs[1]
                advice = AllocAdvice(str(conf), export_line(conf), other, there.needed, there)
        return dict(
            reserved_bytes=reserved,
            fragmentation_bytes=reserved - peak,
            outside=outside.parts,
            needed_bytes=here.needed,
            fits=here.fits,
            reserved_replayed=replayed_here or not self.confs,
            fits_with=advice,
            fit=here,
        )

    def reserved_at(self, cell: Cell, peak: int, index: int) -> int:
        """The cell's reserved peak under setting ``index``."""
        return peak + self._fragmentation(cell, peak)[0][index]

    def _fragmentation(self, cell: Cell, peak: int) -> tuple[list[int], bool]:
        """Per setting, the cell's reserved minus allocated bytes, and whether they
        come from the cell's own run."""
        if not self.confs:
            return [], True
        own = self.figures(cell)
        if own is not None:
            run_peak = _peak(own)
            # the run's own replay; where the plan's line puts the cell above the run,
            # the run's fragmentation on top of the line's peak
            return [max(own[RESERVED + str(c)] - min(peak, run_peak), 0) for c in self.confs], True
        made = [c for c in self.runs() if c.checkpointing == cell.checkpointing]
        # world size 1 holds whole parameters, gradients and states: other blocks fragment
        same = [c for c in made if (c.world_size == 1) == (cell.world_size == 1)] or made
        gap = min(abs(math.log2(c.micro_batch / cell.micro_batch)) for c in same)
        runs = [
            self.figures(c) for c in same if abs(math.log2(c.micro_batch / cell.micro_batch)) == gap
        ]
        frags = [max(max(r[RESERVED + str(c)] - _peak(r), 0) for r in runs) for c in self.confs]
        # every segment, and every page of an expandable one, is a multiple of 2 MiB
        return [_up_to(peak + f, SEGMENT_STEP) - peak for f in frags], False


def _up_to(n: float, step: int) -> int:
    return math.ceil(n / step) * step


def _top_phase(figures: dict[str, int]) -> tuple[str, int]:
    """A run's highest phase and its peak (the phase peaks alone: other figures are
    named ``kind:...``)."""
    return max(((k, v) for k, v in figures.items() if ":" not in k), key=lambda kv: kv[1])


def _peak(figures: dict[str, int]) -> int:
    return _top_phase(figures)[1]


def settle(rows: list[PlanRow], fit: ReservedFit, replay: Callable, best: Callable):
    """The rows with the best one and the best advised one replayed from their own
    fake steps (``replay(cells)`` makes the runs, in parallel where it can), repeating
    while a replay changes the choice; and the checks of carried against replayed
    figures. Both candidates of a round are replayed together: on two or more cores
    the second run costs no wall time. After each round every carried row is carried
    again: the new runs are runs at their micro-batches, so the next candidates'
    figures already count what the replays found."""
    checks: list[ReservedCheck] = []
    while True:
        wanted = []
        for index, advise in enumerate((False, True)):
            row = best(_candidates(rows, advise))
            if row is not None and not row.reserved_replayed:
                wanted.append((row, index))
        if not wanted:
            return rows, tuple(checks)
        replay([r.cell for r, _ in wanted])
        checks += [_check(r, fit, index) for r, index in wanted]
        rows = [r if r.reserved_replayed else _again(r, fit) for r in rows]


def _again(row: PlanRow, fit: ReservedFit) -> PlanRow:
    """``row`` after the replays: its own run's peaks where it now has one, and its
    reserved fields anew."""
    if fit.figures(row.cell) is not None:
        return with_own_run(row, fit)
    return dataclasses.replace(row, **fit.fields(row.cell, row.peak_bytes))


def with_own_run(row: PlanRow, fit: ReservedFit) -> PlanRow:
    """A cell with a fake step of its own reports that step's allocated peak and
    phase, as ``profile --fake`` of the cell gives them, and the reserved fields
    that go with it; the line's figure only estimates it (how far, the plan's
    linearity checks report). The difference goes to ``temporaries``."""
    own = fit.figures(row.cell)
    if own is None:
        return row
    phase, peak = _top_phase(own)
    b = row.breakdown
    breakdown = dataclasses.replace(b, temporaries=b.temporaries + peak - row.peak_bytes)
    return dataclasses.replace(
        row,
        peak_bytes=peak,
        peak_phase=phase,
        breakdown=breakdown,
        measured=True,
        **fit.fields(row.cell, peak),
    )


def keeping_margin(rows) -> list:
    """The rows (``PlanRow`` or ``SchemeRow``) that fit keeping the plan's margin free
    (their ``Fit``): the candidates for a best row."""
    return [r for r in rows if r.fit.keeps_margin]


def advised(rows) -> list:
    """The rows that fit keeping the margin free under the advised allocator setting."""
    return [r for r in rows if r.fits_with is not None and r.fits_with.fit.keeps_margin]


def _candidates(rows: list[PlanRow], advise: bool) -> list[PlanRow]:
    return advised(rows) if advise else keeping_margin(rows)


def _check(old: PlanRow, fit: ReservedFit, index: int) -> ReservedCheck:
    """``old``'s carried reserved peak under setting ``index`` against its replay."""
    carried = old.fits_with.reserved_bytes if index else old.reserved_bytes
    cell = old.cell
    now = fit.reserved_at(cell, old.peak_bytes, index)
    conf = str(fit.confs[index])
    return ReservedCheck(cell.world_size, cell.micro_batch, cell.checkpointing, conf, carried, now)
