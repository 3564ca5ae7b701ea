"""``plan --scheme``: the step's peak per rank under FSDP2, ZeRO-1/2/3 and DDP beside
the flat scheme, over the plan's grid.

The flat scheme's rows are the plan's own cells. FSDP2's and DDP's are their engines'
own fake steps, every rank (``engine_rows``): a row shows the fullest rank (the one
that needs the most, allocator and all), ``ranks`` every rank group's figures. The
rest, ZeRO-1/2/3 (DeepSpeed needs CUDA to run), are modelled, and say so
(``Scheme.modelled``):

A modelled scheme's peak at (world size, micro-batch, checkpointing) is the highest
phase of what it holds then (``Scheme.phase_peak``: persistent bytes, gathered
parameters, gradients and their buffers as the scheme has them at that phase) plus
the step's own bytes then, activations and temporaries, from the flat step the plan
measures (``measure``):

- schemes that compute on sharded-then-gathered units (flat, fsdp2, zero3) take the
  flat step of the same cell: the same activations, and temporaries whose per-rank
  part (gradients not yet reduced, optimizer temporaries) is a shard's;
- schemes whose forward and backward run on whole parameters (ddp, zero1, zero2)
  take the cell's micro-batch and checkpointing at world size 1 (the step of the
  whole model).

The same step gives what it held at each phase's peak (``Runner.unheld``,
``Runner.grads``; ``_RowMaker._steps``): the step's own bytes are measured apart from
the flat model's buffers and gradients, and a scheme's holdings are put in their
place.

Whether a scheme's cell fits is the plan's reserved test: the peak plus the
fragmentation the caching allocator adds (an engine's own step replayed; for a
modelled scheme, the flat step's replay of that cell: the schemes allocate the same
activations and temporaries, only their persistent blocks differ), plus what the
rank holds beside the allocator, at most the GPU's memory; the best configuration
keeps the plan's margin free too.

With gradient accumulation (``--grad-accum``) every reference step runs the step's
micro-batches, so each scheme holds what its reference holds between them (the flat
runtime's reduced shards, FSDP2's with gradient sync on, DDP's whole gradients under
``no_sync()``); a scheme that can switch gradient sync off until the last micro-batch
(FSDP2) also gets its best configuration so (``Scheme.unsynced``: every gradient held
whole through the micro-batches).

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
from ..memory.step_schemes import SchemeParts, SchemeSettings, StepAt, scheme_memory
from ..mesh import Mesh
from ..schemes import FLAT, FSDP2, Scheme, parse
from .cell import Cell, grid
from .engine_rows import ENGINES, EngineRunner
from .measure import ACTS, Runner
from .plan_options import PlanOptions
from .plan_report import NOT_WRITTEN
from .reserved_fit import ReservedFit, keeping_margin, top_phase


@dataclass(frozen=True, slots=True)
class RankPeak:
    """Ranks ``first`` to ``last`` (inclusive) of a scheme's cell each peak so."""

    first: int
    last: int
    peak_bytes: int
    reserved_bytes: int
    needed_bytes: int
    peak_phase: str


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
    # every rank group's figures, rank order (the row's are the fullest's); empty where
    # the scheme is modelled (its figures are its fullest rank's)
    ranks: tuple[RankPeak, ...] = ()
    modelled: bool = False  # from the memory model's parts, not a run of the engine
    rank_spread_bytes: int = 0  # the fullest rank's peak minus the emptiest's

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
    # with --grad-accum, a scheme that can switch gradient sync off until the last
    # micro-batch (``Scheme.unsynced``: fsdp2): its best configuration so
    no_sync_peak_bytes: int | None = None
    no_sync_fits: bool | None = None
    modelled: bool = False  # the rows are modelled, not run (``Scheme.modelled``)
    method: str = ""  # how the rows were had, in words

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
    fit: ReservedFit,
    sizes: tuple[int, ...],
    settings: SchemeSettings | None = None,
    engines: EngineRunner | None = None,
) -> tuple[SchemePlan, ...]:
    """Every scheme of ``opts.schemes`` over the plan's grid of world sizes
    (``sizes``); ``runner`` and ``fit`` are the plan's (``fit_grid``): the runner
    measures the world-size-1 cells the modelled whole-parameter schemes need where
    the plan's grid has none; ``engines``: the engine schemes' steps (the plan's pool
    ran most of them; the rest run here); ``settings``: the schemes' knobs (their
    defaults where None)."""
    settings = settings or SchemeSettings()
    chosen = planned_schemes(opts)
    cells = grid(map(Mesh.data_parallel, sizes), opts.micro_batches, opts.checkpointing)
    if any(s.whole_params and s.modelled for s in chosen):
        runner.prefetch([_reference(c, True) for c in cells])
    if engines is None:
        engines = EngineRunner(loaded, opts, runner.seq_len, runner.origin)
    engines.measure(chosen, cells, settings)  # what the plan's pool did not run
    memory = _scheme_memory(loaded, opts)
    rows = _RowMaker(opts, memory, fit, runner, settings, engines)
    grids = {s: tuple(rows(s, c) for c in cells) for s in chosen}
    flat_best = _best(grids[FLAT], opts) if FLAT in grids else None
    return tuple(_scheme_plan(s, grid, grids.get(FLAT, ()), flat_best, rows, opts)
                 for s, grid in grids.items())  # fmt: skip


ACCUM_MODELLED = (
    "with --grad-accum above 1 the engines' rows are modelled: the engines run here "
    "with gradient sync on in every micro-batch, not DDP's no_sync() nor FSDP2's sync "
    "off that accumulating training uses"
)


def planned_schemes(opts: PlanOptions) -> tuple[Scheme, ...]:
    """The schemes ``opts`` names as the plan runs them: with ``--grad-accum`` above 1,
    an engine scheme's rows are modelled (``ACCUM_MODELLED``; the model is checked
    against the real engines accumulating, tests/planning/test_plan_scheme_accum_truth.py)."""
    chosen = parse(opts.schemes)
    if opts.step.grad_accum == 1:
        return chosen
    return tuple(
        s
        if s is FLAT or s.modelled
        else dataclasses.replace(s, engine=None, why_modelled=ACCUM_MODELLED)
        for s in chosen
    )


def _reference(cell: Cell, whole_params: bool) -> Cell:
    """The flat step a scheme's cell stands on: the cell's own, or at world size 1."""
    return Cell.at(1, cell.micro_batch, cell.checkpointing) if whole_params else cell


class _RowMaker:
    """``(scheme, cell) -> SchemeRow``."""

    def __init__(self, opts, memory: Callable, fit, runner: Runner, settings, engines):
        self.opts, self.memory, self.fit, self.runner = opts, memory, fit, runner
        self.settings, self.engines = settings, engines
        self.whole_grads = memory.whole_grads  # world size -> every gradient whole

    def __call__(
        self, scheme: Scheme, cell: Cell, settings: SchemeSettings | None = None, extra=None
    ) -> SchemeRow:
        """``extra``: ``(phase, breakdown) -> bytes`` held beyond the scheme's own."""
        settings = settings or self.settings
        if scheme in ENGINES:
            return self._engine_row(scheme, cell, settings)
        ws, ck = cell.world_size, cell.checkpointing
        m = self.memory(scheme, ws, settings)
        steps = self._steps(_reference(cell, scheme.whole_params))
        more = extra or (lambda _p, _m: 0)
        phase, peak = max(
            (
                (p, scheme.phase_peak(p, m, at, ws, settings) + more(p, m))
                for p, at in steps.items()
            ),
            key=lambda pair: pair[1],
        )
        act = steps[phase].activations
        # the flat step's fragmentation at this cell: the schemes allocate the same
        # activations and temporaries, only their persistent blocks differ
        reserved = peak + self.fit.fragmentation(cell)
        outside = self.fit.outside(ws).total
        verdict = headroom.fit(reserved, outside, self.opts.memory.gpu_memory, self.fit.margin)
        ranks = ()
        if not scheme.modelled:  # the flat scheme: every rank's shards are alike
            ranks = (RankPeak(0, ws - 1, peak, reserved, verdict.needed, phase),)
        return SchemeRow(
            scheme, ws, cell.micro_batch, ck, peak, reserved, verdict.needed, m.persistent,
            m.gather, m.reduce, act, peak - m.total - act, phase, verdict.fits, verdict,
            ranks=ranks, modelled=scheme.modelled,
        )  # fmt: skip

    def _engine_row(self, scheme: Scheme, cell: Cell, settings) -> SchemeRow:
        """The fullest rank of the engine's own steps (the one that needs the most),
        every rank group's figures beside; the scheme's holdings from the memory
        model, the step's activations at the peak, the rest its temporaries."""
        m = self.memory(scheme, cell.world_size, settings)
        groups = []
        for r in self.engines.ranks(scheme, cell, settings):
            fields = self.fit.fields_of(r.figures, cell)
            phase = top_phase(r.figures)[0]
            groups.append((r, fields, phase))
        fullest, f, phase = max(groups, key=lambda g: (g[1]["needed_bytes"], g[1]["peak_bytes"]))
        peak, act = f["peak_bytes"], fullest.figures.get(ACTS + phase, 0)
        ranks = tuple(
            RankPeak(r.first, r.last, g["peak_bytes"], g["reserved_bytes"], g["needed_bytes"], p)
            for r, g, p in groups
        )
        peaks = [g.peak_bytes for g in ranks]
        return SchemeRow(
            scheme, cell.world_size, cell.micro_batch, cell.checkpointing, peak,
            f["reserved_bytes"], f["needed_bytes"], m.persistent, m.gather, m.reduce, act,
            peak - m.total - act, phase, f["fits"], f["fit"], ranks=ranks, modelled=False,
            rank_spread_bytes=max(peaks) - min(peaks),
        )  # fmt: skip

    def unsynced(self, scheme: Scheme, cell: Cell) -> SchemeRow | None:
        """``scheme``'s row at ``cell`` with gradient sync off until the last of the
        step's micro-batches (``Scheme.unsynced``); None where the scheme has no such
        switch. Its reference step is the cell's own, as with sync on: the same
        micro-batches, activations and temporaries."""
        whole = self.whole_grads(cell.world_size)
        if cell.world_size == 1 or scheme.unsynced("optimizer", None, whole) is None:
            return None
        return self(scheme, cell, extra=lambda p, m: scheme.unsynced(p, m, whole))

    def _steps(self, ref: Cell) -> dict[str, StepAt]:
        """The flat step of ``ref`` at each phase's peak (``StepAt``): its activations,
        the rest of its bytes beyond the model's, and what of the model it held then."""
        excess, acts = self.runner.excess(ref), self.runner.activations(ref)
        unheld, grads = self.runner.unheld(ref), self.runner.grads(ref)
        return {
            p: StepAt(acts[p], excess[p] - acts[p], unheld[p], max(grads[p], 0)) for p in excess
        }


def _scheme_plan(scheme, rows, flat_rows, flat_best, make: _RowMaker, opts) -> SchemePlan:
    best = _best(rows, opts)
    where = best or flat_best
    at = where.cell if where else None
    flat = next((r for r in flat_rows if r.cell == at), None)
    mine = next((r for r in rows if r.cell == at), None)
    saves = mine.peak_bytes - flat.peak_bytes if flat and mine else None
    plan = SchemePlan(
        scheme, scheme.configuration(make.settings), rows, _smallest(rows, opts), best, at,
        flat.peak_bytes if flat else None, saves, modelled=scheme.modelled,
        method=_method(scheme, make),
    )  # fmt: skip
    if best is None or best.world_size == 1:
        return plan
    if opts.step.grad_accum > 1 and (unsynced := make.unsynced(scheme, best.cell)) is not None:
        plan = dataclasses.replace(
            plan, no_sync_peak_bytes=unsynced.peak_bytes, no_sync_fits=unsynced.fits
        )
    if scheme is not FSDP2:
        return plan
    no_reshard = dataclasses.replace(make.settings, reshard_after_forward=False)
    kept = make(scheme, best.cell, settings=no_reshard)
    return dataclasses.replace(
        plan, no_reshard_peak_bytes=kept.peak_bytes, no_reshard_fits=kept.fits
    )


def _method(scheme: Scheme, make: _RowMaker) -> str:
    """How the scheme's rows were had, in words."""
    if scheme in ENGINES:
        how = make.engines.how(scheme, make.settings)
        return f"{scheme.engine} run in the fake step, a fake process group: {how}"
    if scheme.modelled:
        return (
            f"modelled, not run ({scheme.why_modelled}): what it holds from the memory "
            "model's parts, the flat step's activations and temporaries"
        )
    return "the plan's own fake steps of the flat engine (every rank's shards alike)"


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

    @cache
    def whole_grads(ws: int) -> int:
        layout, report = layout_and_report(ws)
        return SchemeParts(layout, cfg, SchemeSettings(), report).whole_grads()

    memory.whole_grads = whole_grads
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
