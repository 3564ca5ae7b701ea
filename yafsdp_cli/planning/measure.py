"""The fake steps behind a plan: every cell of the grid measured.

A cell's figures are those of one fake step of the converted model at the cell's
world size, micro-batch and checkpointing (``profiling.profile_converted``, the step
``profile --fake`` runs, with the plan's ``--grad-accum`` micro-batches): its phase
peaks, what the model held at each (``HELD``, ``GRADS``), the activations alive then
(``ACTS``), the micro-batch each peak is in (``MICRO``), and its allocations replayed
through the caching allocator's model (``reserved_fit``). Nothing is carried from one
cell to another, so a cell reads the same whatever grid or objective it is asked in.

A rank of a sharded model runs the same ops at every world size above 1; only its
shard-sized and buffer-sized storages change size (``profiling.shard_sizes``). So
the cells above world size 1 of one micro-batch and checkpointing choice are one
fake step (a ``Job``) and its events with each world size's own sizes: the events a
step run there records, each replayed on its own. A step whose events cannot be
rewritten so is run at every world size. World size 1 runs the unsharded model, a
step of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..options import MemoryOptions
from ..profiling import ProfileOptions
from ..profiling.profiler import profile_converted
from ..profiling.timeline import StepEvents
from .cell import Cell
from .plan_options import PlanOptions
from .pool import Origin, run_jobs
from .reserved_fit import RESERVED, may_advise, plan_confs, replayed

PHASES = ("forward", "backward", "optimizer")
# a run's figures beside its phase peaks: what the model held at each phase's peak
# (parameters, gradients, optimizer states, buffers), of that its gradients, the
# activations alive then, and the micro-batch it was in (``--grad-accum``)
HELD, GRADS, ACTS, MICRO = "held:", "grads:", "acts:", "micro:"


@dataclass(frozen=True, slots=True)
class Job:
    """One fake step at ``cell`` and its events at each of ``world_sizes`` (its own
    among them): what one process computes for the plan."""

    cell: Cell
    world_sizes: tuple[int, ...]

    def cells(self) -> list[Cell]:
        mb, ck = self.cell.choice
        return [Cell.at(ws, mb, ck) for ws in self.world_sizes]

    def run(self, loaded, opts: PlanOptions, seq_len: int):
        return measure_job(loaded, opts, seq_len, self)


def measure_peaks(loaded, opts: PlanOptions, seq_len: int, cell: Cell) -> dict[str, int]:
    """The figures of one fake step of the converted model at ``cell``."""
    return run_figures(_step(loaded, opts, seq_len, cell).events, opts, cell)


def measure_job(loaded, opts: PlanOptions, seq_len: int, job: Job):
    """Every cell of ``job``: ``({cell: figures}, fake steps run)``."""
    step = _step(loaded, opts, seq_len, job.cell)
    found, steps = {}, 1
    for cell in job.cells():
        events = step.events if cell == job.cell else step.at_world_size(cell.world_size)
        if events is None:  # not rewritable: the cell's own step
            events, steps = _step(loaded, opts, seq_len, cell).events, steps + 1
        found[cell] = run_figures(events, opts, cell)
    return found, steps


def _step(loaded, opts: PlanOptions, seq_len: int, cell: Cell):
    """One fake step at ``cell`` (``shard_sizes.RecordedStep``)."""
    steps: dict = {}
    profile_converted(loaded, step_options(opts, seq_len, cell), steps=steps)
    return steps["converted"]


def step_options(opts: PlanOptions, seq_len: int, cell: Cell) -> ProfileOptions:
    """What a fake step at ``cell`` is asked: the plan's layout, step and rounding at
    the cell's world size, micro-batch and checkpointing."""
    return ProfileOptions(
        layout=dataclasses.replace(opts.layout, world_size=cell.world_size),
        step=dataclasses.replace(
            opts.step, batch=cell.micro_batch, seq_len=seq_len, checkpointing=cell.checkpointing
        ),
        # the step's own rounding; the plan's GPU and allocator settings are applied
        # to its trace afterwards (``reserved_fit``)
        memory=MemoryOptions(round_bytes=opts.round_bytes),
        fake=True,
    )


def run_figures(events: StepEvents, opts: PlanOptions, cell: Cell, trace=None) -> dict[str, int]:
    """A step's phase peaks, what the model held at each (``HELD``, ``GRADS``), the
    activations then (``ACTS``), and its reserved peak under the plan's allocator
    setting; under the setting a plan may advise too, where that could change the
    verdict: the cell does not fit under its own, and its allocated peak would.
    ``trace``: the events' allocation trace, where it is made already."""
    with _collector_paused():
        return _figures_at(events, opts, (cell,), trace)[cell]


@contextlib.contextmanager
def _collector_paused():
    """The replays make tens of thousands of small tuples each, none of them in a
    cycle; with a plan's other steps alive, the collector's full passes over every
    object cost more than the replays themselves (the 70B config's 80 cells: 8.9 s of
    figures, 5.1 s with the collector paused)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def figures_at(events: StepEvents, opts: PlanOptions, cells) -> dict[Cell, dict[str, int]]:
    """``run_figures`` of one step's events at each of ``cells`` (a step the same at
    every world size: DDP's), its allocations replayed once; under the setting a plan
    may advise, once, where some cell needs it."""
    with _collector_paused():
        return _figures_at(events, opts, tuple(cells))


def _figures_at(events: StepEvents, opts: PlanOptions, cells, trace=None) -> dict:
    phase_peaks, breakdowns, micro = events.phase_peaks()
    figures = dict(phase_peaks)
    for p, b in breakdowns.items():
        figures[HELD + p] = b.parameters + b.gradients + b.optimizer + b.buffers
        figures[GRADS + p] = b.gradients
        figures[ACTS + p] = b.activations
        figures[MICRO + p] = micro[p]
    confs = plan_confs(opts)
    if not confs:
        return {c: figures for c in cells}
    trace = trace or events.alloc_trace()
    figures.update(replayed(trace, confs[:1]))
    own = figures[RESERVED + str(confs[0])]
    advised = None
    out = {}
    for cell in cells:
        if len(confs) > 1 and may_advise(opts, cell, own, max(phase_peaks.values())):
            advised = advised or {**figures, **replayed(trace, confs[1:])}
            out[cell] = advised
        else:
            out[cell] = figures
    return out


class Runner:
    """The figures of every cell a plan asks for, counting the fake steps; ``prefetch``
    makes a set of them at once (on several cores, see ``pool``)."""

    def __init__(
        self,
        loaded,
        opts: PlanOptions,
        seq_len: int,
        model_total: Callable,
        origin: Origin | None = None,
    ):
        self.loaded, self.opts, self.seq_len = loaded, opts, seq_len
        self.model_total = model_total  # world size -> the memory model's bytes
        self.origin = origin
        self.jobs = 1  # the most processes that ran steps at once
        self.steps = 0  # fake steps run; ``runs`` counts the cells they gave
        self._figures: dict[Cell, dict[str, int]] = {}

    def prefetch(self, cells: Sequence[Cell]) -> None:
        jobs = self.wanted(cells)
        if jobs:
            found, processes = run_jobs(
                jobs, loaded=self.loaded, opts=self.opts, seq_len=self.seq_len, origin=self.origin
            )
            self.take(found, processes)

    def wanted(self, cells: Sequence[Cell]) -> list[Job]:
        """The jobs that measure those of ``cells`` not measured yet: world size 1 a
        job per cell; above it, one job per micro-batch and checkpointing, its step at
        the smallest world size."""
        sharded: dict[tuple[int, str], list[int]] = {}
        jobs = []
        for cell in dict.fromkeys(cells):
            if cell in self._figures:
                continue
            if cell.world_size == 1:
                jobs.append(Job(cell, (1,)))
            else:
                sharded.setdefault(cell.choice, []).append(cell.world_size)
        for (mb, ck), sizes in sharded.items():
            sizes = sorted(set(sizes))
            jobs.append(Job(Cell.at(sizes[0], mb, ck), tuple(sizes)))
        return jobs

    def take(self, found: dict, processes: int) -> None:
        """The results of ``run_jobs`` (its jobs of this runner's, others' ignored)."""
        self.jobs = max(self.jobs, processes)
        for job, result in found.items():
            if isinstance(job, Job):
                figures, steps = result
                self._figures.update(figures)
                self.steps += steps

    @property
    def runs(self) -> int:
        return len(self._figures)

    def figures(self, cell: Cell) -> dict[str, int]:
        """A cell's figures, measured now if they are not yet."""
        self.prefetch([cell])
        return self._figures[cell]

    def excess(self, cell: Cell) -> dict[str, int]:
        """Each phase's measured peak minus the model's bytes at the cell's world size."""
        peaks, base = self.figures(cell), self.model_total(cell.world_size)
        return {p: peaks[p] - base for p in PHASES if p in peaks}

    def unheld(self, cell: Cell) -> dict[str, int]:
        """Per phase, the model's bytes at the cell's world size minus what the step
        held of them at that phase's peak: buffers not in use then, gradients not yet
        made."""
        peaks, base = self.figures(cell), self.model_total(cell.world_size)
        return {p: base - peaks[HELD + p] for p in PHASES if HELD + p in peaks}

    def grads(self, cell: Cell) -> dict[str, int]:
        """Per phase, the gradients alive at that phase's peak."""
        peaks = self.figures(cell)
        return {p: peaks[GRADS + p] for p in PHASES if GRADS + p in peaks}

    def activations(self, cell: Cell) -> dict[str, int]:
        """Per phase, the activations alive at that phase's peak."""
        peaks = self.figures(cell)
        return {p: peaks[ACTS + p] for p in PHASES if ACTS + p in peaks}
