"""Which storages a training step allocates, when, and what each one is for.

[Note: why a dispatch mode of our own, not torch's MemTracker]
``torch.distributed._tools.mem_tracker.MemTracker`` (torch 2.13), on the sample
models and on the 70B Llama config under FakeTensorMode, 2 CPU cores:

- it files everything allocated inside ``optimizer.step()`` as optimizer state, so
  the step's temporaries count as state: on the converted sample GPT it reports
  1,564,428 B of "Optstate" at the peak where the states are 964,620 B (the rest is
  AdamW's ``denom`` of a whole flat buffer, a temporary);
- after every op it walks every module it tracks and deep-copies snapshots: a fake
  forward + backward + for-loop AdamW step of the 70B config takes 234 s (original)
  and 227 s (converted, 35 s of it the forward alone), against about 5 s for the
  same step without it;
- it needs ``reset_mod_stats()`` between steps and has no notion of our phases.

It does count the flat gradient buffer as a gradient (its grad hooks see the flat
parameter), so correctness is not the problem; the two above are. This mode is a
few dozen lines: every op's output storages become blocks with their size and
birth phase; a weakref on each storage records its free; ``resize_`` (which the
sharded runtime uses to free and refill whole buffers, and which no dispatch mode
sees) is wrapped while tracking. Roles are given at known points (parameters,
buffers and optimizer state at the start; gradients right after backward and as
each whole flat gradient is handed to the reduce-scatter; optimizer state after
the step), and a role holds for the block's whole life: the flat gradient buffer,
allocated by ``zeros_like`` inside backward, is a gradient from its first byte.
A block with no role is an activation if the forward made it, else a temporary.
The categories at the peak therefore sum to the peak by construction.

Each block also keeps the CUDA stream it was allocated on (0 where there is no
GPU: fake tensors run on none), so ``alloc_trace`` can hand the caching
allocator's model (``memory.caching_allocator``) the step as the allocator sees it.

Each block also remembers the modules whose forward was running when it was made;
``replay`` then gives, at the step's peak, the activation bytes alive by the
innermost of them (the module that made them), so those rows add up to the peak's
activations less what no module made (the batch, the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary, weakref

from ..engine.layout import round_up
from ..memory.caching_allocator import AllocTrace, TraceEvent

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
PHASES = ("forward", "backward", "optimizer")
SERIES_BUCKETS = 150  # per phase: a series keeps each stretch's lowest and highest total
_SIZE, _PHASE, _ENTER, _EXIT = 0, 1, 2, 3


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


def op_tensors(*groups) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or results: each is a Tensor, an
    optional one, or a list of them (``Tensor[]``, ``Tensor?[]``), never deeper; a
    faster walk than ``tree_flatten``, which every op of a 70B step pays for."""
    out = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class StorageTracker(TorchDispatchMode):
    """See the note above. Use: ``with tracker: ...``, with ``set_phase`` between
    the phases, ``assign`` for roles, ``replay()`` at the end."""

    def __init__(self, round_bytes: int = 1):
        super().__init__()
        self.round_bytes = round_bytes
        self._index = WeakIdKeyDictionary()  # storage -> block id
        self._size: list[int] = []
        self._role: list[str | None] = []
        self._born: list[str] = []
        self._where: list[tuple[str, ...]] = []  # modules whose forward made the block
        self._stream: list[int] = []  # the CUDA stream the block was allocated on
        self._streams = torch.cuda.is_available()  # else every block is on stream 0
        self._events: list[tuple] = []
        self._refs: list = []
        self._phase = "setup"
        self._active: tuple[str, ...] = ()
        self._closed = False  # frees after tracking stopped are not part of the step
        self.ops = 0

    # -- recording ---------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        self._phase = phase
        self._events.append((_PHASE, phase))

    def enter_module(self, name: str, backward: bool) -> None:
        if not backward:
            self._active = (*self._active, name)
        self._events.append((_ENTER, name, backward))

    def exit_module(self, name: str, backward: bool) -> None:
        if not backward and name in self._active:
            i = len(self._active) - 1 - self._active[::-1].index(name)
            self._active = self._active[:i] + self._active[i + 1 :]
        self._events.append((_EXIT, name, backward))

    def assign(self, tensors, role: str) -> None:
        """Give the storages of ``tensors`` (any nesting) ``role``; unseen ones are
        registered as alive now. The first role a block gets is kept."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                i = self._see(t.untyped_storage())
                if self._role[i] is None:
                    self._role[i] = role

    def _see(self, st) -> int:
        i = self._index.get(st)
        if i is not None:
            return i
        i = len(self._size)
        self._index[st] = i
        self._size.append(0)
        self._role.append(None)
        self._born.append(self._phase)
        self._where.append(self._active)
        self._stream.append(self._stream_of(st) if self._streams else 0)
        self._refs.append(weakref.ref(st, partial(self._freed, i)))
        self._resize(i, st.nbytes())
        return i

    @staticmethod
    def _stream_of(st) -> int:
        if st.device.type != "cuda" or not torch.cuda.is_initialized():
            return 0
        return torch.cuda.current_stream(st.device).stream_id

    def _resize(self, i: int, nbytes: int) -> None:
        size = round_up(nbytes, self.round_bytes) if nbytes else 0
        if size != self._size[i]:
            self._events.append((_SIZE, i, size - self._size[i]))
            self._size[i] = size

    def _freed(self, i: int, _ref) -> None:
        if not self._closed:
            self._resize(i, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in op_tensors(out if isinstance(out, (list, tuple)) else (out,)):
            self._see(t.untyped_storage())
        return out

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            result = tracker._orig_resize(st, size)
            i = tracker._index.get(st)
            if i is not None:
                tracker._resize(i, st.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        self._closed = True
        return super().__exit__(*exc)

    # -- replay ------------------------------------------------------------------------

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category of ``t``'s storage, or None if the tracker never saw it."""
        i = self._index.get(t.untyped_storage())
        return None if i is None else self.category(i)

    def category(self, i: int) -> str:
        role = self._role[i]
        if role is not None:
            return role
        return "activations" if self._born[i] in ("setup", "forward") else "temporaries"

    def replay(self, modules_of_interest=None) -> Timeline:
        """Walk the events in order; ``modules_of_interest`` (names) get ModuleMemory."""
        cats = [self.category(i) for i in range(len(self._size))]
        state = _Replay(cats, self._born, self._where, modules_of_interest or ())
        for ev in self._events:
            state.step(ev)
        timeline = state.result(self.ops, len(self._size))
        made = self._made_at(state.peak_event, cats)
        return replace(timeline, peak_by_module=made)

    def alloc_trace(self) -> AllocTrace:
        """The step's allocations and frees as the caching allocator sees them, in
        order: a block's first bytes allocate it, its last free it, and a resize in
        between (``resize_``) allocates the new size before it frees the old, as the
        copy it makes needs both. ``step_start``: the events before the forward (the
        parameters, optimizer state and batch, registered as they are assigned)."""
        events: list[TraceEvent] = []
        size: dict[int, int] = {}
        trace_id: dict[int, int] = {}  # block -> its current allocation's id
        step_start = None
        for ev in self._events:
            if ev[0] == _PHASE and ev[1] == "forward" and step_start is None:
                step_start = len(events)
            if ev[0] != _SIZE:
                continue
            i, old = ev[1], size.get(ev[1], 0)
            new = size[i] = old + ev[2]
            if new > 0:
                events.append(TraceEvent(len(events), new, self._stream[i]))
            if old > 0:
                events.append(TraceEvent(trace_id.pop(i), 0, self._stream[i]))
            if new > 0:
                trace_id[i] = events[-1 if old == 0 else -2].block
        return AllocTrace(tuple(events), len(events) if step_start is None else step_start)

    def _made_at(self, last: int, cats: list[str]) -> dict[str, int]:
        """Activation bytes alive after event ``last``, by the innermost module that
        made them (a second pass: the peak is known only once the step is over)."""
        alive: dict[int, int] = {}
        for ev in self._events[: last + 1]:
            if ev[0] == _SIZE:
                alive[ev[1]] = alive.get(ev[1], 0) + ev[2]
        out: dict[str, int] = {}
        for i, size in alive.items():
            if size > 0 and cats[i] == "activations" and self._where[i]:
                name = self._where[i][-1]
                out[name] = out.get(name, 0) + size
        return out


class _Replay:
    def __init__(self, cats, born, where, modules):
        self.cats, self.born, self.where = cats, born, where
        self.sums = dict.fromkeys(CATEGORIES, 0)
        self.total = self.peak_total = 0
        self.peak = dict(self.sums)
        self.phase = self.peak_phase = "setup"
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
        if kind == _SIZE:
            self._size(ev[1], ev[2])
        elif kind == _PHASE:
            if ev[1] == "backward" and self.phase == "forward":
                self._count_saved()
            self.phase = ev[1]
            self.trace.setdefault(self.phase, []).append(self.total)
            self._bump_phase()
        elif kind in (_ENTER, _EXIT) and ev[1] in self.wanted:
            active = self.bwd if ev[2] else self.fwd
            n = active.get(ev[1], 0) + (1 if kind == _ENTER else -1)
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
                self.peak_event = self.event
            self._bump_phase()
            self._bump_modules()

    def _bump_phase(self) -> None:
        if self.total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.total
            self.phase_sums[self.phase] = dict(self.sums)

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
