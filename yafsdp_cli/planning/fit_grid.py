"""``plan_source``: peak per rank over a grid of world size, micro-batch and
activation checkpointing, and whether each fits a GPU.

The persistent bytes of each world size come from the memory model (flat
scheme: shards of parameters, gradients, optimizer states and master weights,
replicated buffers, the all-gather and gradient buffers of the largest unit); every
cell's peak, activations and reserved peak from its own fake step (``measure``):
one step per micro-batch and checkpointing choice above world size 1, its events
at each world size's shard sizes, and one per cell at world size 1. So a cell's
figure does not depend on the grid, the objective or the other cells; where the
grid is not monotone (more memory for a smaller micro-batch or for more GPUs),
``--explain`` says which part of the two cells moved (``monotonicity``).
"""

from __future__ import annotations

import dataclasses
import time
from functools import cache

from ..engine.choices import describe_checkpointing
from ..engine.losses import resolve_loss, vocab_size
from ..engine.plan import plan
from ..engine.records import retype_params
from ..memory import estimate_memory
from ..memory.step_schemes import SchemeSettings
from ..mesh import Mesh
from ..profiling.positions import position_limit
from ..schemes import FLAT
from ..sources import load_source
from ..sources.adapted import adapt, keeps_stored_base
from .cell import Cell, grid
from .cell_time import CellTimer, best_timed, timed_rows, timing_setup, with_timing
from .engine_rows import EngineRunner
from .measure import MICRO, Runner
from .plan_options import MAX_WORLD_SIZE, PlanOptions
from .plan_report import (
    PastPositions,
    PlanAdvice,
    PlanBreakdown,
    PlanReport,
    PlanRow,
    Smallest,
)
from .pool import Origin, run_jobs
from .reserved_fit import ReservedFit, advised, keeping_margin, top_phase
from .scheme_peaks import compare_schemes, planned_schemes

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
    loss = resolve_loss(loaded.module, opts.step.loss)  # a wrong --loss fails before the steps
    opts, dropped = _without_missing_units(loaded, opts)
    memory = _memory_model(loaded, opts)
    sizes = opts.world_sizes or tuple(2**k for k in range(MAX_WORLD_SIZE.bit_length()))
    runner = Runner(loaded, opts, seq_len, lambda ws: memory(ws).total, origin)
    fit = ReservedFit(opts, runner.figures)
    cells = grid(map(Mesh.data_parallel, sizes), opts.micro_batches, opts.checkpointing)
    setup = timing_setup(opts)
    timer = CellTimer(loaded, opts, seq_len, setup, origin) if setup is not None else None
    # the memory steps, the kernel counts and the engine schemes' steps in one pool:
    # its workers start once
    jobs = runner.wanted(cells)
    if timer is not None:
        jobs += timer.wanted(opts.micro_batches, opts.checkpointing)
    engines = EngineRunner(loaded, opts, seq_len, origin)
    settings = scheme_settings or SchemeSettings()
    jobs += engines.wanted(planned_schemes(opts), cells, settings)
    found, processes = run_jobs(jobs, loaded=loaded, opts=opts, seq_len=seq_len, origin=origin)
    runner.take(found, processes)
    engines.take(found)
    rows = [_row(c, seq_len, memory(c.world_size), runner, fit) for c in cells]
    if timer is not None:
        timer.take(found)
        rows = timed_rows(timer, rows)
    chooser = best_row if setup is None else _by_objective(opts)
    if opts.world_sizes is None:  # cut keeping the chosen rows
        best, advice = _best_and_advice(rows, opts)
        timed = chooser(keeping_margin(rows))
        chosen = [r.world_size for r in (best, timed, advice and advice.row) if r is not None]
        rows = _up_to_enough(rows, opts, at_least=max(chosen, default=1))
    report = _report(loaded, opts, seq_len, rows, runner, start, fit)
    if setup is not None:
        report = with_timing(report, rows, timer, opts)
    if opts.schemes != (FLAT.name,):
        sizes = tuple(dict.fromkeys(r.world_size for r in rows))  # the plan's own grid
        schemes = compare_schemes(loaded, opts, runner, fit, sizes, settings, engines)
        report = dataclasses.replace(
            report, schemes=schemes, fake_runs=runner.runs, fake_steps=runner.steps
        )
    tuning = getattr(loaded, "tuning_notes", ())  # --freeze, --lora, --quantize
    brief = getattr(loaded, "tuning_brief", ())
    mb = report.best.micro_batch if report.best is not None else min(opts.micro_batches)
    return dataclasses.replace(
        report,
        loss=loss.name,
        loss_detail=loss.describe(mb * seq_len, vocab_size(loaded.module)),
        notes=(*dropped, *tuning, *report.notes),
        tuning=brief,
        past_positions=_past_positions(loaded.module, seq_len),
    )


def _past_positions(module, seq_len: int) -> PastPositions | None:
    """The config's position limit where ``seq_len`` is past it. A learned position
    table fails the step first (``profiling.positions``); what runs this far has
    rotary positions, whose limit is the length the model was trained at."""
    limit = position_limit(module)
    if limit is None or seq_len <= limit[1]:
        return None
    return PastPositions(*limit)


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
    if any(layout.blocks):
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


def _row(cell: Cell, seq_len, m, runner: Runner, fit: ReservedFit) -> PlanRow:
    """A cell's row: its own step's peak, phase and activations, the memory model's
    persistent parts at its world size, and the rest (the step's temporaries, less
    what the model's bytes it did not hold then) as ``temporaries``."""
    fields = fit.fields(cell)
    figures = runner.figures(cell)
    phase = top_phase(figures)[0]
    act = runner.activations(cell)[phase]
    breakdown = PlanBreakdown(
        m.params, m.grads, m.optimizer, m.master, m.buffers, m.gather, m.reduce, act,
        fields["peak_bytes"] - m.total - act,
    )  # fmt: skip
    return PlanRow(
        world_size=cell.world_size,
        micro_batch=cell.micro_batch,
        seq_len=seq_len,
        checkpointing=cell.checkpointing,
        breakdown=breakdown,
        peak_phase=phase,
        peak_micro_batch=figures[MICRO + phase],
        **fields,
    )


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
        f"{opts.memory.margin_bytes} B free; every cell replayed from its own run"
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


def _report(loaded, opts, seq_len, rows, runner, start, fit) -> PlanReport:
    cfg = opts.memory_config()
    best, advice = _best_and_advice(rows, opts)
    return PlanReport(
        source=loaded.spec.source,
        gpu_memory_bytes=opts.memory.gpu_memory,
        reserve_bytes=opts.memory.reserve,
        round_bytes=opts.round_bytes,
        seq_len=seq_len,
        param_dtype=opts.step.param_dtype or "as stored",
        grad_dtype=cfg.grad_dtype or "the parameters' dtype",
        optimizer=opts.step.optimizer,
        optimizer_impl=opts.step.optimizer_impl,
        grad_accum=opts.step.grad_accum,
        world_sizes=tuple(dict.fromkeys(r.world_size for r in rows)),
        micro_batches=tuple(opts.micro_batches),
        checkpointing=tuple(opts.checkpointing),
        rows=tuple(rows),
        smallest=smallest_fitting(rows),
        best=best,
        fake_runs=runner.runs,
        fake_steps=runner.steps,
        wall_s=time.perf_counter() - start,
        notes=(*_notes(opts, runner, fit), *monotonicity(rows)),
        alloc_conf=fit.alloc_conf,
        margin_bytes=opts.memory.margin_bytes,
        advice=advice,
    )


def _notes(opts: PlanOptions, runner: Runner, fit) -> tuple[str, ...]:
    return (
        "peak per rank = the memory model's persistent bytes at each world size (flat "
        "scheme: shards, master weights, buffers, 2 all-gather and 2 gradient buffers of "
        "the largest unit) + activations and temporaries of the converted model's step at "
        "the cell, measured under FakeTensorMode",
        f"{runner.runs} fake runs, one per cell ({runner.jobs} at a time, --jobs), from "
        f"{runner.steps} fake steps: above world size 1, one step per micro-batch and "
        "checkpointing, its shard-sized allocations resized to each world size (the events "
        "a step run there records); at world size 1, a step per cell",
        _fit_note(opts, fit),
        "checkpointing reentrant / non-reentrant: torch.utils.checkpoint around every unit "
        "(transformers' own activation_checkpointing_enable where the model has it)",
        *filter(None, map(describe_checkpointing, opts.checkpointing)),
        f"kernels: {opts.step.target}'s"
        + (
            " (attention as CUDA's sdpa kernels save it, the optimizer's foreach default)"
            if opts.step.target == "cuda"
            else ""
        ),
        *_accum_note(opts),
    )


def _accum_note(opts: PlanOptions) -> tuple[str, ...]:
    n = opts.step.grad_accum
    if n == 1:
        return ()
    return (
        f"gradient accumulation: every cell's fake step runs {n} micro-batches (forward "
        "and backward each; from the second on, the gradients of the ones before are "
        "held through the forward, the flat scheme's as reduced shards above world size "
        "1), then one optimizer step; three are traced and the rest written from the "
        "third where it repeats the second event for event, else all are traced",
    )


def monotonicity(rows) -> tuple[str, ...]:
    """A note for each pair of neighbouring cells where more micro-batch needs less
    memory, or more GPUs more, naming which of the cells' parts moved: the step's
    peak phase, its allocated peak, the caching allocator's fragmentation, the
    memory beside the allocator (NCCL's buffers grow with the world size)."""
    at = {r.cell: r for r in rows}
    mbs = sorted({r.micro_batch for r in rows})
    sizes = sorted({r.world_size for r in rows})
    notes = []
    for r in rows:
        i, j = mbs.index(r.micro_batch), sizes.index(r.world_size)
        smaller = at.get(Cell.at(r.world_size, mbs[i - 1], r.checkpointing)) if i else None
        if smaller is not None and r.needed_bytes < smaller.needed_bytes:
            notes.append(_not_monotone(smaller, r, "micro-batch"))
        fewer = at.get(Cell.at(sizes[j - 1], r.micro_batch, r.checkpointing)) if j else None
        if fewer is not None and r.needed_bytes > fewer.needed_bytes:
            notes.append(_not_monotone(fewer, r, "world size"))
    return tuple(notes)


def _not_monotone(a: PlanRow, b: PlanRow, axis: str) -> str:
    """Why ``b`` (one step up ``axis`` from ``a``) needs less, or more, than ``a``."""
    more = "less" if axis == "micro-batch" else "more"
    why = []
    if a.peak_phase != b.peak_phase:
        why.append(f"the peak moved from the {a.peak_phase} to the {b.peak_phase}")
    parts = (
        ("allocated peak", a.peak_bytes, b.peak_bytes),
        ("fragmentation", a.fragmentation_bytes, b.fragmentation_bytes),
        ("beside the allocator", sum(p.bytes for p in a.outside), sum(p.bytes for p in b.outside)),
    )
    why += [f"{name} {_signed(y - x)}" for name, x, y in parts if x != y]
    return (
        f"not monotone ({a.checkpointing}): world size {b.world_size} micro-batch "
        f"{b.micro_batch} needs {more} than world size {a.world_size} micro-batch "
        f"{a.micro_batch} ({b.needed_bytes} B against {a.needed_bytes} B): " + "; ".join(why)
    )


def _signed(n: int) -> str:
    return f"{'+' if n >= 0 else '-'}{abs(n)} B"
