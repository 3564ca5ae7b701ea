"""The fake runs behind a plan, and the straight lines fitted through them.

A step's peak is the persistent bytes (the memory model's, exact per rank) plus what
the step makes: activations, which grow with micro-batch x sequence, and
temporaries. For one world size and checkpointing choice, each phase's peak minus
the model's bytes is measured under FakeTensorMode at two micro-batches and fitted
as ``const + slope * micro_batch``; one more run at a second world size (one
micro-batch: activations do not depend on the world size) makes the constant
``const + per_rank / world_size``, for what is a shard's size (gradients not yet
reduced at the peak, optimizer temporaries); a third micro-batch, where the grid has
one, checks that the line holds. The plan's cell is the model's bytes at its own
world size plus the highest phase of the line at its micro-batch and world size.

A rank of a sharded model runs the same ops at every world size above 1; only its
shard-sized and buffer-sized storages change size (``profiling.shard_sizes``). So
of the runs above world size 1 at one micro-batch and checkpointing choice (the
line's and the second world size's, and the reserved replays ``reserved_fit`` asks
for later) one is a fake step and the others are its events with their own world
size's sizes: the figures a fake step of their own gives, for no fake step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..options import MemoryOptions
from ..profiling import ProfileOptions
from ..profiling.profiler import profile_converted
from ..profiling.shard_sizes import RecordedStep
from ..profiling.timeline import StepEvents
from .cell import Cell
from .plan_options import PlanOptions
from .plan_report import LinearityCheck
from .pool import Origin, run_cells
from .reserved_fit import plan_confs, replayed

PHASES = ("forward", "backward", "optimizer")
# a run's figures beside its phase peaks: what the model held at each phase's peak
# (parameters, gradients, optimizer states, buffers), and of that its gradients
HELD, GRADS = "held:", "grads:"


@dataclass(frozen=True, slots=True)
class PhaseLine:
    """Per phase, the step's bytes beyond the model's: ``const + slope * micro_batch``."""

    world_sizes: tuple[int, ...]  # where it was measured
    checkpointing: str
    const: dict[str, float]
    slope: dict[str, float]
    per_rank: dict[str, float] | None = None  # None: measured at one world size
    # past ``knee``, the segment to the third micro-batch (a phase's peak is the
    # highest of several moments, so it bends upwards; the chord stays above it)
    knee: int | None = None
    upper: tuple[dict[str, float], dict[str, float]] | None = None  # (const, slope)

    def at(self, micro_batch: int, world_size: int) -> tuple[str, int, int]:
        """(phase, activations, temporaries) of the highest phase."""

        const, slope = self.const, self.slope
        if self.upper is not None and self.knee is not None and micro_batch > self.knee:
            const, slope = self.upper

        def temp(p: str) -> float:
            inv = self.per_rank[p] / world_size if self.per_rank else 0.0
            return const[p] + inv

        phase = max(
            (p for p in PHASES if p in const),
            key=lambda p: temp(p) + slope[p] * micro_batch,
        )
        return phase, round(slope[phase] * micro_batch), round(temp(phase))

    def excess(self, micro_batch: int, world_size: int) -> int:
        _, act, temp = self.at(micro_batch, world_size)
        return act + temp


def measure_peaks(loaded, opts: PlanOptions, seq_len: int, cell: Cell) -> dict[str, int]:
    """The phase peaks of one fake step of the converted model at ``cell``, and its
    reserved peak under each of the plan's allocator settings (``reserved_fit``)."""
    return measure_step(loaded, opts, seq_len, cell)[0]


def measure_step(loaded, opts: PlanOptions, seq_len: int, cell: Cell):
    """``measure_peaks`` and the step it measured (``shard_sizes.RecordedStep``), from
    which the same step at another world size is had without running it."""
    steps: dict = {}
    profile_converted(
        loaded,
        ProfileOptions(
            layout=dataclasses.replace(opts.layout, world_size=cell.world_size),
            step=dataclasses.replace(
                opts.step,
                batch=cell.micro_batch,
                seq_len=seq_len,
                checkpointing=cell.checkpointing,
            ),
            # the step's own rounding; the plan's GPU and allocator settings are applied
            # to its trace afterwards (``reserved_fit``)
            memory=MemoryOptions(round_bytes=opts.memory.round_bytes),
            fake=True,
        ),
        steps=steps,
    )
    step = steps["converted"]
    return run_figures(step.events, opts), step


def run_figures(events: StepEvents, opts: PlanOptions) -> dict[str, int]:
    """A step's phase peaks, what the model held at each (``HELD``, ``GRADS``), and its
    reserved peak under each of the plan's allocator settings."""
    timeline = events.replay()
    figures = dict(timeline.phase_peaks)
    for p, b in timeline.phase_breakdowns.items():
        figures[HELD + p] = b.parameters + b.gradients + b.optimizer + b.buffers
        figures[GRADS + p] = b.gradients
    confs = plan_confs(opts)
    if confs:
        figures.update(replayed(events.alloc_trace(), confs))
    return figures


class Runner:
    """The figures of fake steps of the converted model, counting them; ``prefetch``
    makes a set of them at once (on several cores, see ``pool``) for ``excess`` to
    read. Of the runs at world sizes above 1 with the same micro-batch and
    checkpointing, one is a fake step and the others are its events at their own
    shard sizes (``shard_sizes``: the events a step run there records)."""

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
        self.steps = 0  # fake steps run; ``runs`` counts the runs they gave
        self._peaks: dict[Cell, dict[str, int]] = {}
        self._sharded: dict[tuple[int, str], RecordedStep] = {}  # (mb, ck) -> a sharded step

    def prefetch(self, cells: Sequence[Cell]) -> None:
        wanted = [c for c in dict.fromkeys(cells) if c not in self._peaks]
        for every in (False, True):  # then every step that cannot be rewritten
            left = self._rewritten(wanted)
            if not left:
                return
            self._run_steps(left if every else self._one_per_step(left))

    def _run_steps(self, cells: list[Cell]) -> None:
        found, jobs = run_cells(
            cells,
            self._measure,
            measure_step,
            loaded=self.loaded,
            opts=self.opts,
            seq_len=self.seq_len,
            origin=self.origin,
        )
        self.jobs = max(self.jobs, min(jobs, len(cells)) if self.origin else 1)
        self.steps += len(cells)
        for cell, (figures, step) in found.items():
            self._peaks[cell] = figures
            known = self._sharded.get(cell.choice)
            if cell.world_size > 1 and (known is None or not known.rewritable):
                self._sharded[cell.choice] = step

    def _rewritten(self, cells: list[Cell]) -> list[Cell]:
        """Give each cell whose micro-batch and checkpointing have a sharded step that
        can be rewritten for its world size its figures; the cells left."""
        left = []
        for cell in cells:
            step = self._sharded.get(cell.choice) if cell.world_size > 1 else None
            events = step.at_world_size(cell.world_size) if step is not None else None
            if events is not None and cell not in self._peaks:
                self._peaks[cell] = run_figures(events, self.opts)
            elif cell not in self._peaks:
                left.append(cell)
        return left

    def _one_per_step(self, cells: list[Cell]) -> list[Cell]:
        """Every cell at world size 1, and of those above, the first of each micro-batch
        and checkpointing (the others are its events at their own world sizes), or
        all of them where a step of theirs could not be rewritten."""
        seen: set[tuple[int, str]] = set()
        out = []
        for cell in cells:
            if cell.world_size == 1 or cell.choice not in seen or cell.choice in self._sharded:
                out.append(cell)
            if cell.world_size > 1:
                seen.add(cell.choice)
        return out

    @property
    def runs(self) -> int:
        return len(self._peaks)

    def made(self) -> list[Cell]:
        """The runs made so far."""
        return list(self._peaks)

    def figures(self, cell: Cell) -> dict[str, int] | None:
        """A run's figures (phase peaks, reserved peaks), None if it is not made."""
        return self._peaks.get(cell)

    def _measure(self, cell: Cell):
        return measure_step(self.loaded, self.opts, self.seq_len, cell)

    def excess(self, world_size: int, micro_batch: int, checkpointing: str) -> dict[str, int]:
        """Each phase's measured peak minus the model's bytes at ``world_size``."""
        peaks = self._run(world_size, micro_batch, checkpointing)
        base = self.model_total(world_size)
        return {p: peaks[p] - base for p in PHASES if p in peaks}

    def unheld(self, world_size: int, micro_batch: int, checkpointing: str) -> dict[str, int]:
        """Per phase, the model's bytes at ``world_size`` minus what the step held of
        them at that phase's peak: buffers not in use then, gradients not yet made."""
        peaks = self._run(world_size, micro_batch, checkpointing)
        base = self.model_total(world_size)
        return {p: base - peaks[HELD + p] for p in PHASES if HELD + p in peaks}

    def grads(self, world_size: int, micro_batch: int, checkpointing: str) -> dict[str, int]:
        """Per phase, the gradients alive at that phase's peak."""
        peaks = self._run(world_size, micro_batch, checkpointing)
        return {p: peaks[GRADS + p] for p in PHASES if GRADS + p in peaks}

    def _run(self, world_size: int, micro_batch: int, checkpointing: str) -> dict[str, int]:
        cell = Cell.at(world_size, micro_batch, checkpointing)
        self.prefetch([cell])
        return self._peaks[cell]

    def line(
        self,
        ws: int,
        checkpointing: str,
        micro_batches,
        ws2: int | None,
        of: Callable | None = None,
    ) -> PhaseLine:
        """Two runs at ``ws`` (one if the grid has one micro-batch), fitted per
        phase, and one at ``ws2`` (if given) for the per-rank part; of the runs'
        ``excess`` or another per-phase figure ``of(ws, mb, checkpointing)``."""
        of = of or self.excess
        points = sorted(set(micro_batches))[:2]
        measured = [of(ws, mb, checkpointing) for mb in points]
        if len(points) == 1:  # one point: proportional through zero, exact there
            slope = _slopes(measured[0], points[0])
        else:
            (m1, e1), (m2, e2) = zip(points, measured)
            slope = {p: (e2[p] - e1[p]) / (m2 - m1) for p in e1 if p in e2}
        const = {p: measured[0][p] - slope[p] * points[0] for p in slope}
        if ws2 is None:
            return PhaseLine((ws,), checkpointing, const, slope)
        other = of(ws2, points[0], checkpointing)
        const2 = {p: other[p] - slope[p] * points[0] for p in const if p in other}
        per_rank = {p: (const[p] - const2[p]) / (1 / ws - 1 / ws2) for p in const2}
        base = {p: const[p] - per_rank[p] / ws for p in per_rank}
        return PhaseLine((ws, ws2), checkpointing, base, {p: slope[p] for p in base}, per_rank)

    def check(self, line: PhaseLine, micro_batch: int, knee: int):
        """One more run at ``micro_batch``: the line's peak against the measured one,
        and the line with a second segment from ``knee`` to it."""
        ws = line.world_sizes[0]
        measured = self.excess(ws, micro_batch, line.checkpointing)
        base = self.model_total(ws)
        inv = {p: (line.per_rank[p] / ws if line.per_rank else 0.0) for p in line.const}
        at_knee = {p: line.const[p] + inv[p] + line.slope[p] * knee for p in line.const}
        slope = {p: (measured[p] - at_knee[p]) / (micro_batch - knee) for p in at_knee}
        const = {p: at_knee[p] - inv[p] - slope[p] * knee for p in at_knee}
        bent = dataclasses.replace(line, knee=knee, upper=(const, slope))
        return bent, LinearityCheck(
            checkpointing=line.checkpointing,
            world_size=ws,
            micro_batch=micro_batch,
            predicted_bytes=base + line.excess(micro_batch, ws),
            measured_bytes=base + max(measured.values()),
        )


def _slopes(excess: dict[str, int], mb: int) -> dict[str, float]:
    return {p: v / mb for p, v in excess.items()}
