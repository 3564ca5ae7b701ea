"""``plan --scheme``: the step's peak per rank under FSDP2, ZeRO-1/2/3 and DDP beside
the flat scheme, over the plan's grid.

A scheme's peak at (world size, micro-batch, checkpointing) is the highest phase of
what it holds then (``Scheme.phase_peak``: persistent bytes, gathered
parameters, gradients and their buffers as the scheme has them at that phase) plus
the step's own bytes then, activations and temporaries, from the fake runs the plan
already makes (``measure``):

- schemes that compute on sharded-then-gathered units (flat, fsdp2, zero3) take the
  plan's line at that world size, as the flat rows do: the same activations, and
  temporaries whose per-rank part (gradients not yet reduced, optimizer
  temporaries) scales with ``1/world_size``;
- schemes whose forward and backward run on whole parameters (ddp, zero1, zero2)
  take the line measured at world size 1 (the step of the whole model).

The same runs give what the flat step held at each phase's peak (``Runner.unheld``,
``Runner.grads``; ``_RowMaker._held``): the step's own bytes are measured apart from
the flat model's buffers and gradients, and a scheme's holdings are put in their
place.

Whether a scheme's cell fits is the plan's reserved test: the peak plus the
fragmentation the caching allocator adds, taken from the flat step's replayed runs
at that cell (the schemes allocate the same activations and temporaries; only
their persistent blocks differ), plus what the rank holds beside the allocator, at
most the GPU's memory; the best configuration keeps the plan's margin free too.

What the flat scheme saves against a scheme is compared at that scheme's best
configuration (or, where nothing of it fits, at the flat scheme's best): the
scheme's peak minus the flat peak at the same world size, micro-batch and
checkpointing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from ..engine.plan import plan
from ..engine.records import retype_params
from ..memory import estimate_memory, headroom
from ..memory.step_schemes import SchemeSettings, StepAt, scheme_memory
from ..mesh import Mesh
from ..schemes import FLAT, FSDP2, Scheme, parse
from .cell import Cell, grid
from .measure import PhaseLine, Runner
from .plan_options import PlanOptions
from .plan_report import NOT_WRITTEN
from .reserved_fit import ReservedFit, keeping_margin


@dataclass(frozen=True, slots=True)
class SchemeRow:
    """One scheme at one configuration; ``peak_bytes`` = persistent + gather +
    reduce + activations + temporaries."""

    scheme: Scheme
    world_size: int
    micro_batch: int
    checkpointing: str
    peak_bytes: int
    reserved_bytes: int  # peak + the caching allocator's fragmentation
    needed_bytes: int  # reserved + what the rank holds beside the allocator
    persistent_bytes: int  # parameters, gradients, optimizer states, masters, buffers
    gather_bytes: int
    reduce_bytes: int
    activations: int
    temporaries: int
    peak_phase: str
    fits: bool
    fit: headroom.Fit = field(metadata=NOT_WRITTEN)  # ``needed_bytes`` and ``fits``' verdict

    @property
    def cell(self) -> Cell:
        return Cell.at(self.world_size, self.micro_batch, self.checkpointing)


@dataclass(frozen=True, slots=True)
class SchemeSmallest:
    """The fewest GPUs on which ``micro_batch`` fits (and the checkpointing it takes)."""

    micro_batch: int
    world_size: int | None  # None: no world size up to the grid's largest
    checkpointing: str | None


@dataclass(frozen=True, slots=True)
class SchemePlan:
    scheme: Scheme
    configuration: str  # the scheme's settings, in its own terms
    rows: tuple[SchemeRow, ...]
    smallest: tuple[SchemeSmallest, ...]
    best: SchemeRow | None
    compared_at: Cell | None  # written as [world size, micro-batch, checkpointing]
    flat_peak_bytes: int | None  # the flat scheme's peak there
    flat_saves_bytes: int | None  # this scheme's peak minus the flat peak there
    # fsdp2 only: its best configuration with reshard_after_forward=False, which keeps
    # every unit gathered from its forward to its backward (no second all-gather)
    no_reshard_peak_bytes: int | None = None
    no_reshard_fits: bool | None = None

    @property
    def flat_saves_percent(self) -> float | None:
        if self.flat_saves_bytes is None or self.flat_peak_bytes is None:
            return None
        mine = self.flat_peak_bytes + self.flat_saves_bytes
        return 100.0 * self.flat_saves_bytes / mine if mine else 0.0


def compare_schemes(
    loaded,
    opts: PlanOptions,
    runner: Runner,
    lines: dict,
    line_for: Callable,
    fit: ReservedFit,
    sizes: tuple[int, ...],
    settings: SchemeSettings | None = None,
) -> tuple[SchemePlan, ...]:
    """Every scheme of ``opts.schemes`` over the plan's grid of world sizes
    (``sizes``); ``lines``, ``line_for`` and ``fit`` are the plan's (``fit_grid``),
    ``runner`` measures the world-size-1 line if needed; ``settings``: the schemes'
    knobs (their defaults where None)."""
    settings = settings or SchemeSettings()
    chosen = parse(opts.schemes)
    whole = {}
    if any(s.whole_params for s in chosen):
        for ck in opts.checkpointing:
            whole[ck] = lines.get((ck, 1)) or runner.line(1, ck, opts.micro_batches, None)
    line_at = lambda ck, ws: line_for(lines, ck, ws)  # noqa: E731
    rows = _RowMaker(opts, _scheme_memory(loaded, opts), line_at, fit, runner)
    rows.whole, rows.settings = whole, settings
    cells = grid(map(Mesh.data_parallel, sizes), opts.micro_batches, opts.checkpointing)
    grids = {s: tuple(rows(s, c) for c in cells) for s in chosen}
    flat_best = _best(grids[FLAT], opts) if FLAT in grids else None
    return tuple(_scheme_plan(s, grid, grids.get(FLAT, ()), flat_best, rows, opts)
                 for s, grid in grids.items())  # fmt: skip


class _RowMaker:
    """``(scheme, cell) -> SchemeRow``."""

    def __init__(self, opts, memory: Callable, line_at: Callable, fit: ReservedFit, runner):
        self.opts, self.memory, self.line_at, self.fit = opts, memory, line_at, fit
        self.runner = runner
        self.whole: dict[str, PhaseLine] = {}  # checkpointing -> the world-size-1 line
        self.settings = SchemeSettings()
        self._per_rank_parts: dict[tuple, dict[str, float]] = {}

    def __call__(
        self, scheme: Scheme, cell: Cell, settings: SchemeSettings | None = None
    ) -> SchemeRow:
        settings = settings or self.settings
        ws, ck = cell.world_size, cell.checkpointing
        full = scheme.whole_params
        line = self.whole[ck] if full else self.line_at(ck, ws)
        m = self.memory(scheme, ws, settings)
        steps = self._steps(line, cell.micro_batch, 1 if full else ws)
        phase, peak = max(
            ((p, scheme.phase_peak(p, m, at, ws, settings)) for p, at in steps.items()),
            key=lambda pair: pair[1],
        )
        act = steps[phase].activations
        reserved = peak + self._fragmentation(cell)
        outside = self.fit.outside(ws).total
        verdict = headroom.fit(reserved, outside, self.opts.memory.gpu_memory, self.fit.margin)
        return SchemeRow(
            scheme, ws, cell.micro_batch, ck, peak, reserved, verdict.needed, m.persistent,
            m.gather, m.reduce, act, peak - m.total - act, phase, verdict.fits, verdict,
        )  # fmt: skip

    def _steps(self, line: PhaseLine, mb: int, ws: int) -> dict[str, StepAt]:
        """The reference step at each phase's peak (``StepAt``): ``line``'s figures,
        and what the step held then (``_held``)."""
        out = {}
        for p in line.const:
            _, act, temp = _one_phase(line, p).at(mb, ws)
            unheld, grads = (self._held(line, f, p, mb, ws) for f in ("unheld", "grads"))
            out[p] = StepAt(act, temp, unheld, max(grads, 0))
        return out

    def _held(self, line: PhaseLine, figure: str, phase: str, mb: int, ws: int) -> int:
        """What the runs behind ``line`` held at ``phase``'s peak (``Runner.unheld`` or
        ``Runner.grads``) at ``mb`` and ``ws``: between the micro-batches run at the
        line's world size, straight between the nearest two, beyond them the nearest
        one's (which moment is a phase's peak moves with the micro-batch, and settles
        once activations dominate); the per-rank part fitted as the line's is."""
        ws0, ck = line.world_sizes[0], line.checkpointing
        of = getattr(self.runner, figure)
        runs = sorted(
            c.micro_batch
            for c in self.runner.made()
            if c.world_size == ws0 and c.checkpointing == ck
        )
        at = {m: of(ws0, m, ck)[phase] for m in runs}
        value = _between(at, mb)
        if len(line.world_sizes) > 1:
            per_rank = self._per_rank(line, figure)[phase]
            value += per_rank * (1 / ws - 1 / ws0)
        return round(value)

    def _per_rank(self, line: PhaseLine, figure: str) -> dict[str, float]:
        key = (line.world_sizes, line.checkpointing, figure)
        if key not in self._per_rank_parts:
            ws0, ws2 = line.world_sizes[:2]
            of = getattr(self.runner, figure)
            fitted = self.runner.line(ws0, line.checkpointing, self.opts.micro_batches, ws2, of=of)
            self._per_rank_parts[key] = fitted.per_rank or {}
        return self._per_rank_parts[key]

    def _fragmentation(self, cell: Cell) -> int:
        """The caching allocator's reserved minus allocated bytes at the cell, as the
        flat step's replay there has it: added to every scheme's peak (their steps
        allocate the same activations and temporaries)."""
        if not self.fit.confs:
            return 0
        ws = cell.world_size
        _, act, temp = self.line_at(cell.checkpointing, ws).at(cell.micro_batch, ws)
        flat = self.memory(FLAT, ws, SchemeSettings()).total + act + temp
        return self.fit.reserved_at(cell, flat, 0) - flat


def _scheme_plan(scheme, rows, flat_rows, flat_best, make: _RowMaker, opts) -> SchemePlan:
    best = _best(rows, opts)
    where = best or flat_best
    at = where.cell if where else None
    flat = next((r for r in flat_rows if r.cell == at), None)
    mine = next((r for r in rows if r.cell == at), None)
    saves = mine.peak_bytes - flat.peak_bytes if flat and mine else None
    plan = SchemePlan(
        scheme, scheme.configuration(make.settings), rows, _smallest(rows, opts), best, at,
        flat.peak_bytes if flat else None, saves,
    )  # fmt: skip
    if scheme is not FSDP2 or best is None or best.world_size == 1:
        return plan
    no_reshard = dataclasses.replace(make.settings, reshard_after_forward=False)
    kept = make(scheme, best.cell, settings=no_reshard)
    return dataclasses.replace(
        plan, no_reshard_peak_bytes=kept.peak_bytes, no_reshard_fits=kept.fits
    )


def _one_phase(line: PhaseLine, phase: str) -> PhaseLine:
    """``line`` with ``phase`` alone, so that ``at`` gives that phase's figures."""
    keep = lambda d: {phase: d[phase]} if d is not None else None  # noqa: E731
    upper = line.upper and (keep(line.upper[0]), keep(line.upper[1]))
    return dataclasses.replace(
        line, const=keep(line.const), slope=keep(line.slope), per_rank=keep(line.per_rank),
        upper=upper,
    )  # fmt: skip


def _between(at: dict[int, float], x: int) -> float:
    """``at`` (micro-batch -> value) at ``x``: straight between the nearest two
    micro-batches, the nearest one's value beyond them."""
    xs = sorted(at)
    if x <= xs[0] or x >= xs[-1]:
        return at[xs[0] if x <= xs[0] else xs[-1]]
    hi = next(m for m in xs if m >= x)
    lo = max(m for m in xs if m <= x)
    return at[lo] if hi == lo else at[lo] + (at[hi] - at[lo]) * (x - lo) / (hi - lo)


def _scheme_memory(loaded, opts: PlanOptions):
    spec = retype_params(loaded.spec, opts.step.param_dtype)
    cfg = opts.memory_config()

    @cache
    def layout_and_report(ws: int):
        layout = plan(spec, dataclasses.replace(opts.layout, world_size=ws))
        return layout, estimate_memory(layout, cfg)

    @cache
    def memory(scheme: Scheme, ws: int, settings: SchemeSettings):
        layout, report = layout_and_report(ws)
        return scheme_memory(scheme, layout, cfg, settings, report)

    return memory


def _best(rows, opts: PlanOptions) -> SchemeRow | None:
    """As the plan's best: of the cells that fit keeping the margin free, most tokens
    per rank, then no recomputation, then fewest GPUs."""
    fitting = keeping_margin(rows)
    if not fitting:
        return None
    return min(fitting, key=lambda r: (-r.micro_batch, r.checkpointing != "none", r.world_size))


def _smallest(rows, opts: PlanOptions) -> tuple[SchemeSmallest, ...]:
    out = []
    for mb in opts.micro_batches:
        fit = [r for r in rows if r.micro_batch == mb and r.fits]
        if not fit:
            out.append(SchemeSmallest(mb, None, None))
            continue
        first = min(fit, key=lambda r: (r.world_size, r.checkpointing != "none"))
        out.append(SchemeSmallest(mb, first.world_size, first.checkpointing))
    return tuple(out)
