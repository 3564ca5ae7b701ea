"""A tracked step's events and what replaying them gives: the peak, its breakdown by
category, each phase's peak, per-module figures, and the allocation trace the caching
allocator's model takes.

``StorageTracker`` (``tracker``) records a step as ``StepEvents``: each storage is a
block with a role (or none), the phase it was born in and the modules that made it;
the events are its size changes, the phase changes and the modules entered and left,
in order. ``StepEvents`` is plain data: it crosses to another process, and
``shard_sizes.at_world_size`` rewrites it for another world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..memory.caching_allocator import AllocTrace, TraceEvent

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
PHASES = ("forward", "backward", "optimizer")
SERIES_BUCKETS = 150  # per phase: a series keeps each stretch's lowest and highest total
SIZE, PHASE, ENTER, EXIT = 0, 1, 2, 3  # the kinds of event


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Bytes alive at one moment, by category (they sum to ``total``)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    temporaries: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)


@dataclass(frozen=True, slots=True)
class ModuleMemory:
    """Peaks while a module runs, and what its forward leaves alive for backward."""

    name: str
    forward_peak: int  # max bytes alive while its forward ran
    backward_peak: int  # ... while its backward ran
    saved: int  # bytes its forward made that were alive when backward began


@dataclass(frozen=True, slots=True)
class PhaseSeries:
    """Bytes alive through one phase, for a chart: ``events`` totals were seen (the
    total when the phase began, then one after each allocation or free); ``points``
    are ``(index, bytes)`` pairs of them, in order: all of them, or, past
    ``2 * SERIES_BUCKETS``, the lowest and the highest of each of ``SERIES_BUCKETS``
    equal stretches, so the phase's peak is always there."""

    phase: str
    events: int
    points: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class Timeline:
    """A replayed step: the peak and its breakdown, per-phase peaks, per module."""

    peak: Breakdown
    peak_phase: str
    phase_peaks: dict[str, int]
    end: Breakdown  # alive when tracking stopped
    modules: tuple[ModuleMemory, ...]
    ops: int  # dispatched ops seen
    blocks: int  # storages seen
    peak_by_module: dict[str, int]  # activation bytes alive at the peak, by maker
    series: tuple[PhaseSeries, ...] = ()  # forward, backward, optimizer
    # each phase's peak by category: what was alive at that phase's highest moment
    phase_breakdowns: dict[str, Breakdown] = field(default_factory=dict)
    # the micro-batch (1 = the first) each phase's peak was first reached in, and the
    # step's; the optimizer's is the last micro-batch's, after which it runs
    phase_micro_batches: dict[str, int] = field(default_factory=dict)
    peak_micro_batch: int = 1


@dataclass(frozen=True, slots=True)
class StepEvents:
    """A tracked step: per block its ``roles`` (None: by birth), the phase it was
    ``born`` in, the modules whose forward made it (``where``) and its CUDA
    ``stream``; the ``events`` in order (``(SIZE, block, delta)``, ``(PHASE, name)``,
    ``(ENTER | EXIT, module, backward)``) and the ``ops`` dispatched."""

    events: tuple[tuple, ...]
    roles: tuple[str | None, ...]
    born: tuple[str, ...]
    where: tuple[tuple[str, ...], ...]
    stream: tuple[int, ...]
    ops: int
    # per block, the layer of the stack it belongs to (``periodic``; None: not traced so)
    owners: tuple[int | None, ...] | None = None

    def category(self, i: int) -> str:
        role = self.roles[i]
        if role is not None:
            return role
        return "activations" if self.born[i] in ("setup", "forward") else "temporaries"

    def replay(self, modules_of_interest=None) -> Timeline:
        """Walk the events in order; ``modules_of_interest`` (names) get ModuleMemory."""
        cats = [self.category(i) for i in range(len(self.roles))]
        state = _Replay(cats, self.born, self.where, modules_of_interest or ())
        for ev in self.events:
            state.step(ev)
        timeline = state.result(self.ops, len(self.roles))
        made = self._made_at(state.peak_event, cats)
        return replace(timeline, peak_by_module=made)

    def phase_peaks(self) -> tuple[dict[str, int], dict[str, Breakdown], dict[str, int]]:
        """``replay``'s ``phase_peaks``, ``phase_breakdowns`` and
        ``phase_micro_batches`` alone, in one lean pass: a plan takes them for every
        cell of its grid."""
        index = {c: k for k, c in enumerate(CATEGORIES)}
        cats = [index[self.category(i)] for i in range(len(self.roles))]
        sums = [0] * len(CATEGORIES)
        total, phase, micro = 0, "setup", 0
        peaks: dict[str, int] = {}
        at: dict[str, tuple[int, ...]] = {}
        where: dict[str, int] = {}
        for ev in self.events:
            kind = ev[0]
            if kind == SIZE:
                delta = ev[2]
                sums[cats[ev[1]]] += delta
                total += delta
                if delta <= 0 or total <= peaks.get(phase, -1):
                    continue
            elif kind == PHASE:
                phase = ev[1]
                micro += phase == "forward"  # each micro-batch begins with its forward
                if total <= peaks.get(phase, -1):
                    continue
            else:
                continue
            peaks[phase], at[phase], where[phase] = total, tuple(sums), micro
        return (
            {p: v for p, v in peaks.items() if p in PHASES},
            {p: Breakdown(*at[p]) for p in peaks if p in PHASES},
            {p: max(where[p], 1) for p in peaks if p in PHASES},
        )

    def alloc_trace(self, blocks: list[int] | None = None) -> AllocTrace:
        """The step's allocations and frees as the caching allocator sees them, in
        order: a block's first bytes allocate it, its last free it, and a resize in
        between (``resize_``) allocates the new size before it frees the old, as the
        copy it makes needs both. ``step_start``: the events before the forward (the
        parameters, optimizer state and batch, registered as they are assigned).
        ``blocks``, if given, gets each trace event's block, in order."""
        events: list[TraceEvent] = []
        size: dict[int, int] = {}
        trace_id: dict[int, int] = {}  # block -> its current allocation's id
        step_start = None
        for ev in self.events:
            if ev[0] == PHASE and ev[1] == "forward" and step_start is None:
                step_start = len(events)
            if ev[0] != SIZE:
                continue
            i, old = ev[1], size.get(ev[1], 0)
            new = size[i] = old + ev[2]
            if new > 0:
                events.append(TraceEvent(len(events), new, self.stream[i]))
            if old > 0:
                events.append(TraceEvent(trace_id.pop(i), 0, self.stream[i]))
            if blocks is not None:
                blocks += [i] * ((new > 0) + (old > 0))
            if new > 0:
                trace_id[i] = events[-1 if old == 0 else -2].block
        return AllocTrace(tuple(events), len(events) if step_start is None else step_start)

    def _made_at(self, last: int, cats: list[str]) -> dict[str, int]:
        """Activation bytes alive after event ``last``, by the innermost module that
        made them (a second pass: the peak is known only once the step is over)."""
        alive: dict[int, int] = {}
        for ev in self.events[: last + 1]:
            if ev[0] == SIZE:
                alive[ev[1]] = alive.get(ev[1], 0) + ev[2]
        out: dict[str, int] = {}
        for i, size in alive.items():
            if size > 0 and cats[i] == "activations" and self.where[i]:
                name = self.where[i][-1]
                out[name] = out.get(name, 0) + size
        return out


class _Replay:
    def __init__(self, cats, born, where, modules):
        self.cats, self.born, self.where = cats, born, where
        self.sums = dict.fromkeys(CATEGORIES, 0)
        self.total = self.peak_total = 0
        self.peak = dict(self.sums)
        self.phase = self.peak_phase = "setup"
        self.micro = 0  # the micro-batch running: one per forward phase begun
        self.peak_micro = 1
        self.phase_micro: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self.phase_sums: dict[str, dict[str, int]] = {}  # phase -> sums at its peak
        self.event = self.peak_event = -1  # index of the event that set the peak
        self.alive: dict[int, int] = {}
        self.order = list(modules)
        self.wanted = set(modules)
        self.fwd: dict[str, int] = {}  # active module -> count, forward
        self.bwd: dict[str, int] = {}
        self.fwd_peak: dict[str, int] = {}
        self.bwd_peak: dict[str, int] = {}
        self.saved: dict[str, int] = {}
        self.trace: dict[str, list[int]] = {}  # phase -> totals, for the series

    def step(self, ev) -> None:
        self.event += 1
        kind = ev[0]
        if kind == SIZE:
            self._size(ev[1], ev[2])
        elif kind == PHASE:
            if ev[1] == "backward" and self.phase == "forward":
                self._count_saved()
            self.phase = ev[1]
            self.micro += self.phase == "forward"
            self.trace.setdefault(self.phase, []).append(self.total)
            self._bump_phase()
        elif kind in (ENTER, EXIT) and ev[1] in self.wanted:
            active = self.bwd if ev[2] else self.fwd
            n = active.get(ev[1], 0) + (1 if kind == ENTER else -1)
            if n > 0:
                active[ev[1]] = n
                self._bump_modules()
            else:
                active.pop(ev[1], None)

    def _size(self, i: int, delta: int) -> None:
        self.sums[self.cats[i]] += delta
        self.total += delta
        self.alive[i] = self.alive.get(i, 0) + delta
        if self.phase in self.trace:
            self.trace[self.phase].append(self.total)
        if delta > 0:
            if self.total > self.peak_total:
                self.peak_total, self.peak, self.peak_phase = (
                    self.total,
                    dict(self.sums),
                    self.phase,
                )
                self.peak_event, self.peak_micro = self.event, max(self.micro, 1)
            self._bump_phase()
            self._bump_modules()

    def _bump_phase(self) -> None:
        if self.total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.total
            self.phase_sums[self.phase] = dict(self.sums)
            self.phase_micro[self.phase] = max(self.micro, 1)

    def _bump_modules(self) -> None:
        for active, peaks in ((self.fwd, self.fwd_peak), (self.bwd, self.bwd_peak)):
            for name in active:
                if self.total > peaks.get(name, 0):
                    peaks[name] = self.total

    def _count_saved(self) -> None:
        for i, size in self.alive.items():
            if size > 0 and self.born[i] == "forward":
                for name in set(self.where[i]) & self.wanted:
                    self.saved[name] = self.saved.get(name, 0) + size

    def result(self, ops: int, blocks: int) -> Timeline:
        names = [n for n in self.order if n in self.fwd_peak or n in self.bwd_peak]
        modules = tuple(
            ModuleMemory(n, self.fwd_peak.get(n, 0), self.bwd_peak.get(n, 0), self.saved.get(n, 0))
            for n in names
        )
        return Timeline(
            peak=Breakdown(**self.peak),
            peak_phase=self.peak_phase,
            phase_peaks={p: v for p, v in self.phase_peaks.items() if p in PHASES},
            end=Breakdown(**self.sums),
            modules=modules,
            ops=ops,
            blocks=blocks,
            peak_by_module={},
            series=tuple(
                PhaseSeries(p, len(self.trace[p]), sample_series(self.trace[p]))
                for p in PHASES
                if p in self.trace
            ),
            phase_breakdowns={p: Breakdown(**v) for p, v in self.phase_sums.items() if p in PHASES},
            phase_micro_batches={p: m for p, m in self.phase_micro.items() if p in PHASES},
            peak_micro_batch=self.peak_micro,
        )


def sample_series(values: list[int], buckets: int = SERIES_BUCKETS) -> tuple[tuple[int, int], ...]:
    """``(index, value)`` pairs: every value, or the lowest and highest of each of
    ``buckets`` equal stretches (in index order), so no peak or trough is lost."""
    if len(values) <= 2 * buckets:
        return tuple(enumerate(values))
    out: list[tuple[int, int]] = []
    for b in range(buckets):
        lo, hi = b * len(values) // buckets, (b + 1) * len(values) // buckets
        stretch = range(lo, hi)
        low = min(stretch, key=values.__getitem__)
        high = max(stretch, key=values.__getitem__)
        out += [(i, values[i]) for i in sorted({low, high})]
    return tuple(out)
