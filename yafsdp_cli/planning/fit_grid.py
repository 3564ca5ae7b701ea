"""``plan_source``: peak per rank over a grid of world size, micro-batch and
activation checkpointing, and whether each fits a GPU.

The persistent bytes of each world size come from the memory model (flat
scheme: shards of parameters, gradients, optimizer states and master weights,
replicated buffers, the all-gather and gradient buffers of the largest unit); the
step's own bytes (activations, temporaries) from as few fake runs as the grid
allows (``measure``): two micro-batches per checkpointing choice at one world size
(the smallest above 1 whose persistent bytes fit), the same at world size 1 when it
is in the grid and could fit, and a third micro-batch to check the line; a run at
another world size above 1 is one of those steps with that world size's shard sizes
(``measure``), so it takes no fake step of its own.
"""

from __future__ import annotations

import dataclasses
import time
from functools import cache

from ..engine.plan import plan
from ..engine.records import retype_params
from ..memory import estimate_memory, headroom
from ..mesh import Mesh
from ..schemes import FLAT
from ..sources import load_source
from ..sources.adapted import adapt, keeps_stored_base
from .cell import Cell, grid
from .cell_time import CellTimer, best_timed, timed_rows, timing_setup, with_timing
from .measure import PhaseLine, Runner
from .plan_options import MAX_WORLD_SIZE, PlanOptions
from .plan_report import PlanAdvice, PlanBreakdown, PlanReport, PlanRow, Smallest
from .pool import Origin
from .reserved_fit import ReservedFit, advised, keeping_margin, settle, with_own_run
from .scheme_peaks import compare_schemes

DEFAULT_SEQ_LEN = 2048
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "block_size")


def plan_source(source, *, model=None, trust_pickle=False, opts: PlanOptions) -> PlanReport:
    loaded = load_source(source, model=model, trust_pickle=trust_pickle)
    origin = Origin(None if source is None else str(source), model, trust_pickle)
    report = plan_model(loaded, opts, origin=origin)
    path = None if source is None else str(source)
    return dataclasses.replace(report, source_path=path, model=model, options=opts)


def plan_model(
    loaded, opts: PlanOptions, *, origin: Origin | None = None, scheme_settings=None
) -> PlanReport:
    """The plan of ``loaded`` (``sources.load_source``); see the module docstring.
    With ``origin`` (what loads the same source again) the fake runs may use several
    processes (``pool``); without, they all run here. ``scheme_settings``
    (``memory.step_schemes.SchemeSettings``): the ``--scheme`` rows' knobs, their
    defaults where None."""
    start = time.perf_counter()
    if loaded.module is None:
        loaded.build_module()  # raises: measuring activations needs an architecture
    loaded = adapt(loaded, opts.step)  # --freeze, --lora: the memory model counts them too
    seq_len = opts.step.seq_len or context_length(loaded.module)
    opts, dropped = _without_missing_units(loaded, opts)
    memory = _memory_model(loaded, opts)
    sizes = opts.world_sizes or tuple(2**k for k in range(MAX_WORLD_SIZE.bit_length()))
    runner = Runner(loaded, opts, seq_len, lambda ws: memory(ws).total, origin)
    fit = ReservedFit(opts, runner.figures, runner.model_total, runner.made)
    lines, checks = _measure(runner, opts, sizes, lambda ws: memory(ws).total, fit)
    cells = grid(map(Mesh.data_parallel, sizes), opts.micro_batches, opts.checkpointing)
    rows = [
        _row(c, seq_len, memory(c.world_size), _line_for(lines, c.checkpointing, c.world_size), fit)
        for c in cells
    ]
    setup = timing_setup(opts)
    if setup is not None:
        timer = CellTimer(loaded, opts, seq_len, setup, origin)
        rows = timed_rows(timer, rows)
    chooser = best_row if setup is None else _by_objective(opts)
    rows, reserved_checks = settle(rows, fit, runner.prefetch, chooser)
    if opts.world_sizes is None:  # cut on the settled figures, keeping the chosen rows
        best, advice = _best_and_advice(rows, opts)
        timed = chooser(keeping_margin(rows))
        chosen = [r.world_size for r in (best, timed, advice and advice.row) if r is not None]
        rows = _up_to_enough(rows, opts, at_least=max(chosen, default=1))
    report = _report(loaded, opts, seq_len, rows, runner, lines, checks, start, fit)
    report = dataclasses.replace(
        report,
        reserved_checks=reserved_checks,
        notes=(*report.notes, *map(_reserved_note, reserved_checks)),
    )
    if setup is not None:
        report = with_timing(report, rows, timer, opts)
    if opts.schemes != (FLAT.name,):
        sizes = tuple(dict.fromkeys(r.world_size for r in rows))  # the plan's own grid
        schemes = compare_schemes(
            loaded, opts, runner, lines, _line_for, fit, sizes, scheme_settings
        )
        report = dataclasses.replace(
            report, schemes=schemes, fake_runs=runner.runs, fake_steps=runner.steps
        )
    tuning = getattr(loaded, "tuning_notes", ())  # --freeze, --lora, --quantize
    brief = getattr(loaded, "tuning_brief", ())
    return dataclasses.replace(report, notes=(*dropped, *tuning, *report.notes), tuning=brief)


def context_length(module) -> int:
    """The model's own context length where its config names one, else 2048."""
    config = getattr(module, "config", None)
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_SEQ_LEN


def _without_missing_units(loaded, opts: PlanOptions) -> tuple[PlanOptions, tuple[str, ...]]:
    """A model with no repeated blocks has nothing to checkpoint: plan without it
    (an error when checkpointing was the only choice)."""
    kept = tuple(c for c in opts.checkpointing if c == "none")
    if not kept or kept == tuple(opts.checkpointing):
        return opts, ()
    layout = plan(loaded.spec, opts.layout)
    if any(layout.units):
        return opts, ()
    dropped = ", ".join(c for c in opts.checkpointing if c != "none")
    note = (
        f"checkpointing {dropped} left out: the model has no repeated blocks to checkpoint "
        "(name them with --unit)"
    )
    return dataclasses.replace(opts, checkpointing=kept), (note,)


def _memory_model(loaded, opts: PlanOptions):
    spec = retype_params(loaded.spec, opts.step.param_dtype, keeps_stored_base(loaded))
    cfg = opts.memory_config()

    @cache
    def flat_bytes(world_size: int):
        layout = plan(spec, dataclasses.replace(opts.layout, world_size=world_size))
        return estimate_memory(layout, cfg).flat

    return flat_bytes


def _measure(runner: Runner, opts: PlanOptions, sizes, total, fit: ReservedFit):
    """Lines per (checkpointing, measured world size) and the linearity checks;
    ``total(ws)``: the persistent bytes per rank, which must fit before any step."""

    def persistent_fits(ws: int) -> bool:
        margin = opts.memory.margin_bytes
        return headroom.fit(total(ws), fit.outside(ws).total, opts.memory.gpu_memory, margin).fits

    above_one = [ws for ws in sizes if ws > 1]
    fitting = [ws for ws in above_one if persistent_fits(ws)]
    ref = min(fitting) if fitting else (max(above_one) if above_one else None)
    ref2 = max(above_one) if above_one and max(above_one) != ref else None
    regimes = [ref] if ref is not None else []
    if 1 in sizes and (ref is None or persistent_fits(1)):
        regimes.append(1)
    lines: dict[tuple[str, int], PhaseLine] = {}
    checks = []
    points = sorted(set(opts.micro_batches))
    third = points[2:]
    runner.prefetch(_runs(opts, regimes, ref2, points))
    for ck in opts.checkpointing:
        for ws in regimes:
            lines[(ck, ws)] = runner.line(ws, ck, opts.micro_batches, ref2 if ws > 1 else None)
        if third:
            key = (ck, regimes[0])
            lines[key], check = runner.check(lines[key], third[-1], points[1])
            checks.append(check)
    return lines, tuple(checks)


def _runs(opts: PlanOptions, regimes, ref2, points) -> list[Cell]:
    """The cell of every run ``_measure`` makes."""
    cells = []
    for ck in opts.checkpointing:
        for ws in regimes:
            cells += [Cell.at(ws, point, ck) for point in points[:2]]
            if ws > 1 and ref2 is not None:
                cells.append(Cell.at(ref2, points[0], ck))
        if points[2:] and regimes:
            cells.append(Cell.at(regimes[0], points[-1], ck))
    return cells


def _line_for(lines, checkpointing: str, world_size: int) -> PhaseLine:
    own = lines.get((checkpointing, world_size))
    if own is not None:
        return own
    others = [line for (ck, ws), line in lines.items() if ck == checkpointing and ws > 1]
    return others[0] if others else lines[(checkpointing, 1)]


def _row(cell: Cell, seq_len, m, line: PhaseLine, fit: ReservedFit) -> PlanRow:
    phase, act, temp = line.at(cell.micro_batch, cell.world_size)
    breakdown = PlanBreakdown(
        m.params, m.grads, m.optimizer, m.master, m.buffers, m.gather, m.reduce, act, temp
    )
    peak = m.total + act + temp
    row = PlanRow(
        world_size=cell.world_size,
        micro_batch=cell.micro_batch,
        seq_len=seq_len,
        checkpointing=cell.checkpointing,
        peak_bytes=peak,
        breakdown=breakdown,
        peak_phase=phase,
        measured=cell.world_size in line.world_sizes,
        **fit.fields(cell, peak),
    )
    return with_own_run(row, fit)


def _fit_note(opts: PlanOptions, fit: ReservedFit) -> str:
    beside = "--reserve" if opts.memory.reserve is not None else "context, cuBLAS, cuBLASLt, NCCL"
    if fit.alloc_conf is None:
        return (
            f"fits: allocated peak + the memory beside the allocator ({beside}) <= GPU "
            "memory; --target cpu: no caching allocator replayed"
        )
    return (
        f"fits: reserved peak (the step's allocations replayed through the CUDA caching "
        f"allocator's model, settings: {fit.alloc_conf}) + the memory beside "
        f"the allocator ({beside}) <= GPU memory; best keeps a margin of "
        f"{opts.memory.margin_bytes} B free; cells without a run of their own carry the "
        "fragmentation of the runs at the nearest micro-batch; the best and the advised cells "
        "are replayed from their own runs"
    )


def _reserved_note(c) -> str:
    return (
        f"reserved check ({c.checkpointing}, world size {c.world_size}, micro-batch "
        f"{c.micro_batch}, {c.alloc_conf}): carried {c.carried_bytes} B, replayed from its "
        f"own run {c.replayed_bytes} B, {100 * c.error:.2f}% apart"
    )


def _up_to_enough(rows: list[PlanRow], opts: PlanOptions, at_least: int = 1) -> list[PlanRow]:
    """Default grid: world sizes up to the first where every configuration fits
    keeping the margin free (a cell inside the margin is not a candidate for the
    best row, so a larger world size may still hold the best one), and at least to
    ``at_least``."""
    for ws in sorted({r.world_size for r in rows if r.world_size >= at_least}):
        at = [r for r in rows if r.world_size == ws]
        if len(keeping_margin(at)) == len(at):
            return [r for r in rows if r.world_size <= ws]
    return rows


def smallest_fitting(rows) -> tuple[Smallest, ...]:
    keys = list(dict.fromkeys((r.micro_batch, r.checkpointing) for r in rows))
    out = []
    for mb, ck in keys:
        fit = [
            r.world_size for r in rows if (r.micro_batch, r.checkpointing) == (mb, ck) and r.fits
        ]
        out.append(Smallest(mb, ck, min(fit) if fit else None))
    return tuple(out)


def _by_objective(opts: PlanOptions):
    """The best of candidate rows (already known to fit) under the plan's objective:
    the row ``with_timing`` will choose, so it is the one replayed."""

    def choose(rows):
        got = best_timed(rows, opts.objective, opts.tokens, eligible=lambda r: True)
        return None if got is None else got[0]

    return choose


def best_row(rows) -> PlanRow | None:
    """Most tokens per rank; then no recomputation; then the fewest GPUs (of ``rows``,
    the candidates the caller chose)."""
    if not rows:
        return None
    return min(rows, key=_preference)


def _preference(r: PlanRow) -> tuple:
    return (-r.micro_batch * r.seq_len, r.checkpointing != "none", r.world_size)


def _best_and_advice(rows, opts: PlanOptions) -> tuple[PlanRow | None, PlanAdvice | None]:
    """The best row that fits keeping the margin free; and, when a row that fits only
    under another allocator setting (keeping the margin) beats it, that advice."""
    best = best_row(keeping_margin(rows))
    other = best_row(advised(rows))
    if other is None or (best is not None and _preference(best) <= _preference(other)):
        return best, None
    return best, PlanAdvice(other.fits_with.alloc_conf, other.fits_with.export, other)


def _report(loaded, opts, seq_len, rows, runner, lines, checks, start, fit) -> PlanReport:
    runs = runner.runs
    measured = sorted({ws for line in lines.values() for ws in line.world_sizes})
    cfg = opts.memory_config()
    best, advice = _best_and_advice(rows, opts)
    return PlanReport(
        source=loaded.spec.source,
        gpu_memory_bytes=opts.memory.gpu_memory,
        reserve_bytes=opts.memory.reserve,
        round_bytes=opts.memory.round_bytes,
        seq_len=seq_len,
        param_dtype=opts.step.param_dtype or "as stored",
        grad_dtype=cfg.grad_dtype or "the parameters' dtype",
        optimizer=opts.step.optimizer,
        optimizer_impl=opts.step.optimizer_impl,
        world_sizes=tuple(dict.fromkeys(r.world_size for r in rows)),
        micro_batches=tuple(opts.micro_batches),
        checkpointing=tuple(opts.checkpointing),
        rows=tuple(rows),
        smallest=smallest_fitting(rows),
        best=best,
        fake_runs=runs,
        fake_steps=runner.steps,
        linearity=checks,
        wall_s=time.perf_counter() - start,
        notes=_notes(opts, measured, (runs, runner.steps), checks, runner.jobs, fit),
        alloc_conf=fit.alloc_conf,
        margin_bytes=opts.memory.margin_bytes,
        advice=advice,
        reserved_checks=(),
    )


def _notes(opts: PlanOptions, measured, counts, checks, jobs: int, fit) -> tuple[str, ...]:
    where = ", ".join(map(str, measured))
    runs, steps = counts
    notes = [
        "peak per rank = the memory model's persistent bytes at each world size (flat "
        "scheme: shards, master weights, buffers, 2 all-gather and 2 gradient buffers of "
        "the largest unit) + activations and temporaries of the converted model's step "
        f"measured under FakeTensorMode at world sizes {where}",
        f"{runs} fake runs ({jobs} at a time, --jobs) from {steps} fake steps: activations "
        "grow linearly with micro-batch x sequence, so two micro-batches are measured per "
        "checkpointing choice and the line gives the others; "
        "one run at a second world size gives the part that scales with 1/world size "
        "(unreduced gradients at the peak, optimizer temporaries); runs above world size 1 "
        "with the same micro-batch and checkpointing are one fake step, its shard-sized "
        "allocations resized to each world size",
        _fit_note(opts, fit),
        "checkpointing reentrant / non-reentrant: torch.utils.checkpoint around every unit "
        "(transformers' own activation_checkpointing_enable where the model has it)",
        f"kernels: {opts.step.target}'s"
        + (
            " (attention as CUDA's sdpa kernels save it, the optimizer's foreach default)"
            if opts.step.target == "cuda"
            else ""
        ),
    ]
    second = sorted(set(opts.micro_batches))[1] if len(set(opts.micro_batches)) > 1 else 0
    for c in checks:
        notes.append(
            f"linearity check ({c.checkpointing}, world size {c.world_size}, micro-batch "
            f"{c.micro_batch}): line {c.predicted_bytes} B, measured {c.measured_bytes} B, "
            f"{100 * c.error:.2f}% apart; micro-batches above {second} use the chord to it"
        )
    return tuple(notes)
