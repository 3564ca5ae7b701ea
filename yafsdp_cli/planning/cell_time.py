"""Step time, tokens/s per GPU, MFU and exposed communication for every cell of a plan.

A cell's kernels do not depend on its world size (each rank runs its own
micro-batch; sharding moves bytes between ranks, ``timing.comm_volume``), only on its
micro-batch and checkpointing choice. So the step is counted (``timing.count_step``,
the same fake step ``profile --fake`` runs, every kernel's FLOPs and bytes) at a few
of the grid's micro-batches per checkpointing choice, and every other micro-batch's
kernels come from two of those, kernel by kernel: at a fixed sequence length a
kernel's FLOPs and bytes are ``a + b * micro_batch`` (a product reads its weight once
and its activations per sequence; an optimizer kernel does not depend on the batch
at all), so two counts give both terms exactly, and the roofline then times each
kernel as it would a direct count (``tests/planning/test_cell_time.py`` checks the
line against the cell's own count). A batch of one is a point of its own: a slice
across a batch of one is still contiguous, so a model's loss may copy its labels at
two sequences and not at one (transformers' shifted labels do), and the counts at 1
and 2 then run different kernels. So the counts are the grid's smallest micro-batch
and its two smallest above 1, all in the plan's first pool, and a micro-batch above
them takes the line through the two counted below it. Where those two do not run the
same kernels in the same order, it is counted itself.

Each cell then gets ``timing.estimate_step`` with the layout of its own world size
(the flat scheme's collectives, one unit prefetched), and the best row is the one
``timing.best_cell`` picks under the objective, among the cells that fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from ..engine.plan import plan
from ..engine.records import retype_params
from ..errors import YafsdpError
from ..profiling import ProfileOptions
from ..schemes import FLAT
from ..timing import (
    DEFAULT_OBJECTIVE,
    Cluster,
    Efficiency,
    GpuSpec,
    StepCosts,
    StepEstimate,
    TimedCell,
    best_cell,
    count_step,
    estimate_step,
    gpu_spec,
)
from ..timing.roofline import efficiency_for
from ..timing.step_costs import PHASES, phase_totals
from ..timing.step_estimate import objective_key, phase_times
from .cell import Cell
from .plan_options import PlanOptions
from .plan_report import PlanRow, PlanTiming
from .pool import Origin, run_jobs
from .reserved_fit import keeping_margin


@dataclass(frozen=True, slots=True)
class TimingSetup:
    """What a plan's cells are timed on: the GPU, its kernels' efficiencies, the
    network between nodes."""

    gpu: GpuSpec
    efficiency: Efficiency
    cluster: Cluster


def timing_setup(opts: PlanOptions) -> TimingSetup | None:
    """The GPU that ``opts`` names (``gpu`` from the table, or ``gpu_profile``, a JSON
    file with its own efficiencies); None where it names none."""
    if opts.profile is not None:  # read once, with the options
        gpu, eff = opts.profile.gpu, opts.profile.efficiency
    elif opts.gpu is not None:
        gpu = gpu_spec(opts.gpu)
        eff = efficiency_for(gpu)
    else:
        return None
    cluster = Cluster() if opts.network is None else Cluster(inter_node_bytes_per_s=opts.network)
    return TimingSetup(gpu, eff, cluster)


def count_cell(loaded, opts: PlanOptions, seq_len: int, cell: Cell) -> StepCosts:
    """The kernels of one step of ``cell``; its mesh is not used (a rank's kernels do
    not depend on it)."""
    step = ProfileOptions(
        layout=opts.layout,  # its units: what the checkpointing wraps
        step=dataclasses.replace(
            opts.step,
            batch=cell.micro_batch,
            seq_len=seq_len,
            checkpointing=cell.checkpointing,
        ),
        fake=True,
    )
    return count_step(loaded, step)


def interpolate(low: StepCosts, high: StepCosts, low_mb: int, high_mb: int, mb: int):
    """The step's costs at micro-batch ``mb`` from two counts at ``low_mb`` and
    ``high_mb``, kernel by kernel (see the module docstring); None where the two
    counts do not run the same kernels."""
    if mb in (low_mb, high_mb):
        return low if mb == low_mb else high
    if len(low.ops) != len(high.ops):
        return None
    ops = []
    for a, b in zip(low.ops, high.ops):
        if (a.name, a.phase, a.dtype, a.recompute, len(a.dims)) != (
            b.name,
            b.phase,
            b.dtype,
            b.recompute,
            len(b.dims),
        ):
            return None
        ops.append(
            dataclasses.replace(
                a,
                **{
                    f: _on_line(getattr(a, f), getattr(b, f), low_mb, high_mb, mb)
                    for f in ("matrix_flops", "model_flops", "vector_flops", "bytes")
                },
                dims=tuple(_on_line(x, y, low_mb, high_mb, mb) for x, y in zip(a.dims, b.dims)),
            )
        )
    ops = tuple(ops)
    return dataclasses.replace(
        low,
        ops=ops,
        phases=tuple(phase_totals(ops, p) for p in PHASES),
        tokens=low.tokens // low_mb * mb,
    )


def count_points(micro_batches: Sequence[int]) -> list[int]:
    """The micro-batches a plan counts (see the module docstring): the smallest, and
    the two smallest above 1.

    >>> count_points([1, 2, 4, 8]), count_points([2, 4, 8, 16]), count_points([4])
    ([1, 2, 4], [2, 4], [4])
    """
    ordered = sorted(set(micro_batches))
    return list(dict.fromkeys([*ordered[:1], *[mb for mb in ordered if mb > 1][:2]]))


def _on_line(a: int, b: int, x0: int, x1: int, x: int) -> int:
    """The integer on the line through (x0, a) and (x1, b) at x (exact where the
    counts are linear, as integer counts of a linear function are)."""
    return a + round((b - a) * (x - x0) / (x1 - x0))


@dataclass(frozen=True, slots=True)
class Count:
    """A job (``pool``): the kernels of one step of ``cell``'s micro-batch and
    checkpointing."""

    cell: Cell

    def run(self, loaded, opts: PlanOptions, seq_len: int) -> StepCosts:
        return count_cell(loaded, opts, seq_len, self.cell)


class CellTimer:
    """Counts the kernels a plan's cells need and times each cell."""

    def __init__(self, loaded, opts: PlanOptions, seq_len: int, setup: TimingSetup, origin):
        self.loaded, self.opts, self.seq_len, self.setup = loaded, opts, seq_len, setup
        self.origin: Origin | None = origin
        self.counts: dict[Cell, StepCosts] = {}
        spec = retype_params(loaded.spec, opts.step.param_dtype)
        cfg = opts.memory_config()

        @cache
        def layout(world_size: int):
            return plan(spec, dataclasses.replace(opts.layout, world_size=world_size))

        self.layout, self.cfg = layout, cfg

    def wanted(self, micro_batches: Sequence[int], checkpointing: Sequence[str]) -> list[Count]:
        """The counts not made yet of each checkpointing choice's counted
        micro-batches (``count_points``)."""
        points = count_points(micro_batches)
        return self._wanted([Cell.at(1, mb, ck) for ck in checkpointing for mb in points])

    def _wanted(self, cells: list[Cell]) -> list[Count]:
        return [Count(c) for c in dict.fromkeys(cells) if c not in self.counts]

    def take(self, found: dict) -> None:
        """The results of ``run_jobs`` (its counts; others' jobs ignored)."""
        mine = {job.cell: costs for job, costs in found.items() if isinstance(job, Count)}
        self.counts.update(mine)

    def count(self, micro_batches: Sequence[int], checkpointing: Sequence[str]) -> None:
        """Counts each checkpointing choice's counted micro-batches."""
        self._run(self.wanted(micro_batches, checkpointing))

    def count_missing(self, keys) -> None:
        """Counts each (micro-batch, checkpointing) of ``keys`` that no line reaches,
        all in one pool (its processes run them side by side)."""
        self._run(self._wanted([Cell.at(1, *k) for k in keys if self.derived(*k) is None]))

    def _run(self, jobs: list[Count]) -> None:
        if jobs:
            found, _ = run_jobs(
                jobs, loaded=self.loaded, opts=self.opts, seq_len=self.seq_len, origin=self.origin
            )
            self.take(found)

    @property
    def runs(self) -> int:
        return len(self.counts)

    def costs(self, micro_batch: int, checkpointing: str) -> StepCosts:
        found = self.derived(micro_batch, checkpointing)
        if found is None:
            self._run(self._wanted([Cell.at(1, micro_batch, checkpointing)]))
            found = self.counts[Cell.at(1, micro_batch, checkpointing)]
        return found

    def derived(self, micro_batch: int, checkpointing: str) -> StepCosts | None:
        """The costs from the counts made, counted or on a line; None where the
        micro-batch needs a count of its own."""
        have = sorted(c.micro_batch for c in self.counts if c.checkpointing == checkpointing)
        at = lambda mb: Cell.at(1, mb, checkpointing)  # noqa: E731 - counted at world size 1
        if micro_batch in have:
            return self.counts[at(micro_batch)]
        below = [mb for mb in have if mb < micro_batch][-2:]
        if len(below) == 2:
            low, high = below
            found = interpolate(
                self.counts[at(low)],
                self.counts[at(high)],
                low,
                high,
                micro_batch,
            )
            if found is not None:
                return found
        return None

    def time(self, row: PlanRow, costs: StepCosts, phases=None) -> StepEstimate:
        s = self.setup
        return estimate_step(
            costs,
            self.layout(row.world_size),
            s.gpu,
            scheme=FLAT,
            cluster=s.cluster,
            eff=s.efficiency,
            cfg=self.cfg,
            phases=phases,
        )


def timed_rows(timer: CellTimer, rows: Sequence[PlanRow]) -> list[PlanRow]:
    """``rows`` with each one's step estimate; a (micro-batch, checkpointing) choice's
    kernels are timed on the roofline once, for all its world sizes."""
    timer.count(
        sorted({r.micro_batch for r in rows}), list(dict.fromkeys(r.checkpointing for r in rows))
    )
    timer.count_missing(dict.fromkeys((r.micro_batch, r.checkpointing) for r in rows))
    steps: dict[tuple[int, str], tuple] = {}
    out = []
    for r in rows:
        key = (r.micro_batch, r.checkpointing)
        if key not in steps:
            costs = timer.costs(*key)
            steps[key] = (costs, phase_times(costs, timer.setup.gpu, timer.setup.efficiency))
        out.append(dataclasses.replace(r, time=timer.time(r, *steps[key])))
    return out


def best_timed(
    rows: Sequence[PlanRow],
    objective: str | None,
    tokens: int | None,
    eligible: Callable[[PlanRow], bool] | None = None,
):
    """The best of the timed rows that are ``eligible`` (default: the rows that fit)
    under ``objective`` (default ``timing.DEFAULT_OBJECTIVE``), with its GPU-hours and
    wall hours for ``tokens`` where given: ``(row, gpu_hours, wall_hours)``, or None
    if no row is eligible."""
    if any(r.time is None for r in rows):
        raise YafsdpError("choosing by an objective needs every row timed: name the GPU")
    ok = eligible or (lambda r: r.fits)
    cells = [TimedCell(r.world_size, r.micro_batch, r.checkpointing, ok(r), r.time) for r in rows]
    choice = best_cell(cells, objective or DEFAULT_OBJECTIVE, tokens)
    if choice is None:
        return None
    row = rows[cells.index(choice.cell)]
    return row, choice.gpu_hours, choice.wall_hours


def with_timing(report, rows: Sequence[PlanRow], timer: CellTimer, opts: PlanOptions):
    """``report`` (a ``PlanReport``) with its timed ``rows``, the best row by the
    objective, and what the cells were timed on."""
    objective = opts.objective or DEFAULT_OBJECTIVE
    # the best row keeps the margin free, as the untimed plan's does
    candidates = {id(r) for r in keeping_margin(rows)}
    chosen = best_timed(rows, objective, opts.tokens, eligible=lambda r: id(r) in candidates)
    best, gpu_h, wall_h = chosen if chosen else (None, None, None)
    s = timer.setup
    e = s.efficiency
    timing = PlanTiming(
        gpu=s.gpu.name,
        gpu_source=s.gpu.source,
        network_bytes_per_s=s.cluster.inter_node_bytes_per_s,
        efficiency={
            "matrix": e.matrix,
            "vector": e.vector,
            "memory": e.memory,
            "kernel_floor_s": e.kernel_floor_s,
        },
        objective=objective,
        tokens=opts.tokens,
        gpu_hours=gpu_h,
        wall_hours=wall_h,
        count_runs=timer.runs,
    )
    return dataclasses.replace(
        report, rows=tuple(rows), best=best, timing=timing, notes=(*report.notes, _note(timer))
    )


def _note(timer: CellTimer) -> str:
    s = timer.setup
    nodes = s.gpu.gpus_per_node
    n = timer.opts.step.grad_accum
    accum = (
        f"; {n} micro-batches a step (--grad-accum): the first's kernels, then a later "
        f"one's (counted, its gradient adds included) {n - 1} more times, each with its "
        "all-gathers and reduce-scatters, the optimizer once, tokens per step "
        f"{n} x micro-batch x sequence"
        if n > 1
        else ""
    )
    return (
        f"time per step on {s.gpu.name} ({s.gpu.source}): the roofline over every kernel of "
        f"the step ({timer.runs} counted fake steps{_layers(timer)}; other micro-batches kernel "
        "by kernel on the line through two), plus the flat scheme's all-gathers and "
        "reduce-scatters that compute does not hide with one unit prefetched; ring over "
        f"{nodes} GPUs per node, "
        f"{s.cluster.inter_node_bytes_per_s / 1e9:g} GB/s per GPU between nodes (--network)" + accum
    )


def _layers(timer: CellTimer) -> str:
    """How the counts were had: the whole model, or a few layers repeated."""
    counted = sorted({c.counted for c in timer.counts.values() if c.counted})
    return f", {'; '.join(counted)}" if counted else ""


def ranked_rows(rows: Sequence[PlanRow], objective: str) -> list[PlanRow]:
    """The timed rows that fit, best first under ``objective`` (``best_cell``'s order)."""
    fitting = [r for r in rows if r.fits and r.time]
    if not fitting:
        return []
    fastest = max(r.time.tokens_per_s for r in fitting)
    return sorted(fitting, key=objective_key(objective, fastest))
