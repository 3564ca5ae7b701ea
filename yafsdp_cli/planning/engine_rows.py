"""``plan --scheme``'s FSDP2 and DDP rows: each engine run in the fake step, every rank.

A scheme whose engine runs here (``ENGINES``: FSDP2, DDP; the flat scheme's rows are
the plan's own cells) has its rows from its own fake steps (``profiling.
engine_step``): FSDP2's ``fully_shard`` on every unit and the root, DDP around the
original model, under FakeTensorMode and a fake process group.

One ``EngineJob`` per scheme, micro-batch and checkpointing choice, a picklable
value like ``measure.Job``, so the plan's pool runs it beside the flat steps:

- FSDP2 (``rank_sizes``' note): one step traced on rank 0 at the job's smallest world
  size, and its events rewritten to every other world size and rank; ranks that own
  the same rows of every dimension are one group (``rank_sizes.rank_groups``: most
  models have one per world size; 5 experts on 4 ranks have three), each replayed
  once.
- DDP: every rank holds and runs the same at every world size (nothing is sharded;
  its buckets follow the model alone): one step, on rank 0 of 2, replayed once for
  every world size.
- World size 1: no engine. A training stack wraps a model in FSDP or DDP only to
  train it on more than one rank (torchtitan applies ``fully_shard`` where its
  ``dp_shard`` degree is above 1, DDP where ``dp_replicate`` is), so both schemes'
  rows there are the original model's own step (``engine_step.Unwrapped``): one job,
  ``scheme`` ``UNWRAPPED``, for both.

[Note: one checked step per checkpointing choice]
A step's checks cost a trace each: the periodic step's trace a period deeper
(``periodic``), and FSDP2's rewrite to other world sizes and ranks, checked against
the step traced on the last rank group of the job's largest world size, event for
event. The steps of one scheme and checkpointing choice differ between
micro-batches in their sizes alone, so one job of each, its smallest micro-batch's
(the lead), checks its periodic step; the others trace one period and repeat it
unchecked, and each hands back a digest of its events with every size left out
(``periodic.structure``). FSDP2's rewrite depends on what the engine makes, not on
the batch or the checkpointing: one lead of the scheme checks it, the first
checkpointing choice's. A job stands only where its lead's check held, its digest is
its lead's and (FSDP2) the rewrite held; else it is traced again with its own checks
(``EngineRunner.take``). Where a rewrite does not hold, the job that checked it
traces every world size and rank group itself. ``tests/planning/test_engine_rows.
py`` plants a digest that differs and a rewrite that fails.

A cell's figures are ``measure.run_figures``' (phase peaks, what the model held at
each, the activations, the reserved peaks), per rank group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..memory.step_schemes import SchemeSettings
from ..profiling.rank_sizes import RankTraces, at_rank, rank_groups
from ..schemes import DDP, FSDP2, Scheme, by_name
from .cell import Cell
from .measure import figures_at, run_figures, step_options


@dataclass(frozen=True, slots=True)
class RankFigures:
    """Ranks ``first`` to ``last`` (inclusive) each have these figures."""

    first: int
    last: int
    figures: dict


@dataclass(frozen=True, slots=True)
class EngineResult:
    """A job's figures: per cell, each rank group's; the fake steps traced; how (a
    line for the scheme's notes); its events' digest sizes aside, and whether its
    checks held (see the note)."""

    cells: dict[Cell, tuple[RankFigures, ...]]
    steps: int
    how: str
    digest: str
    sound: bool
    rewrites: bool | None = None  # FSDP2's rewrite checked here: it held; None: not checked
    relies: bool = False  # some of its figures are an unchecked rewrite of its step


UNWRAPPED = ""  # an ``EngineJob``'s scheme at world size 1: no engine, for every scheme
SETTINGS = SchemeSettings()  # the unwrapped step's: it has no engine to set


@dataclass(frozen=True, slots=True)
class EngineJob:
    """One engine's fake steps for one micro-batch and checkpointing choice, at
    ``world_sizes``; ``cell``: the one traced (what ``pool`` orders jobs by);
    ``lead``: it makes the checks the others of its ``family`` rely on (see the
    note)."""

    # ``Scheme.name`` (a name crosses the pipe, the object is looked up), or UNWRAPPED
    scheme: str
    cell: Cell
    world_sizes: tuple[int, ...]
    settings: SchemeSettings
    lead: bool = True
    verify: bool = True  # checks FSDP2's rewrite to other world sizes and ranks

    @property
    def family(self) -> tuple:
        """The jobs that differ from this one in the micro-batch alone."""
        return (self.scheme, self.settings, self.cell.checkpointing, self.world_sizes)

    def run(self, loaded, opts, seq_len: int) -> EngineResult:
        return measure_engine(loaded, opts, seq_len, self)


class EngineRunner:
    """The engine schemes' figures of every cell a plan asks for; ``wanted`` and
    ``take`` put their jobs in the plan's pool, ``ranks`` runs what is missing here."""

    def __init__(self, loaded, opts, seq_len: int, origin=None):
        self.loaded, self.opts, self.seq_len, self.origin = loaded, opts, seq_len, origin
        self.steps = 0  # fake steps traced
        self._cells: dict[tuple, tuple[RankFigures, ...]] = {}
        self._how: dict[tuple, list[str]] = {}  # each lead's how, in words
        self._steps: dict[tuple, int] = {}  # fake steps traced, per scheme and settings
        self._alone: set[tuple] = set()  # families whose jobs each check themselves
        self._verified: dict[tuple, bool] = {}  # (scheme, settings): its rewrite held

    def wanted(self, schemes, cells, settings: SchemeSettings) -> list[EngineJob]:
        """The jobs that give those of ``cells`` not measured yet, for each engine scheme
        of ``schemes``."""
        todo = [
            c
            for c in cells
            if any(_key(s, c, settings) not in self._cells for s in engine_schemes(schemes))
        ]
        jobs = [j for j in engine_jobs(schemes, todo, settings) if not self._has(j)]
        jobs = [_as_lead(j) if j.family in self._alone else j for j in jobs]
        verified = {k for k, held in self._verified.items() if held}
        return [
            dataclasses.replace(j, verify=False)
            if j.verify and (j.scheme, j.settings) in verified
            else j
            for j in jobs
        ]

    def _has(self, job: EngineJob) -> bool:
        mb, ck = job.cell.choice
        return all(
            (job.scheme, job.settings, Cell.at(ws, mb, ck)) in self._cells for ws in job.world_sizes
        )

    def take(self, found: dict) -> None:
        """The results of ``pool.run_jobs`` (its engine jobs; others' ignored). A job
        that relied on a lead whose checks failed, or whose events are not its lead's,
        is left out, and its family checks each job from then on."""
        mine = {j: r for j, r in found.items() if isinstance(j, EngineJob)}
        leads = {j.family: r for j, r in mine.items() if j.lead}
        for j, r in mine.items():
            if r.rewrites is not None:
                key = (j.scheme, j.settings)
                self._verified[key] = self._verified.get(key, True) and r.rewrites
        for job, result in mine.items():
            self.steps += result.steps
            key = (job.scheme, job.settings)
            self._steps[key] = self._steps.get(key, 0) + result.steps
            lead = leads.get(job.family)
            trusted = job.lead or (lead and lead.sound and lead.digest == result.digest)
            if result.relies:
                trusted = trusted and self._verified.get(key) is True
            if not trusted:
                self._alone.add(job.family)
                continue
            for cell, ranks in result.cells.items():
                self._cells[(job.scheme, job.settings, cell)] = ranks
            ways = self._how.setdefault(key, [])
            if job.lead and result.how not in ways:
                ways.append(result.how)

    def measure(self, schemes, cells, settings: SchemeSettings) -> None:
        """Every cell of ``cells`` of each engine scheme, on as many processes as the
        plan's jobs (twice at most: the second time, what the first left out)."""
        from .pool import run_jobs

        for _ in range(2):
            jobs = self.wanted(schemes, cells, settings)
            if not jobs:
                return
            found, _ = run_jobs(
                jobs, loaded=self.loaded, opts=self.opts, seq_len=self.seq_len, origin=self.origin
            )
            self.take(found)

    def ranks(self, scheme: Scheme, cell: Cell, settings: SchemeSettings):
        """Each rank group's figures of ``scheme`` at ``cell``, measured now if not yet."""
        self.measure((scheme,), [cell], settings)
        return self._cells[_key(scheme, cell, settings)]

    def how(self, scheme: Scheme, settings: SchemeSettings) -> str:
        """How ``scheme``'s rows were had, in words: each way, and its fake steps."""
        ways = [*self._how.get((scheme.name, settings), ())]
        steps = self._steps.get((scheme.name, settings), 0)
        if (UNWRAPPED, SETTINGS) in self._how:
            ways.insert(0, self._how[(UNWRAPPED, SETTINGS)][0])
            steps += self._steps.get((UNWRAPPED, SETTINGS), 0)
        return (
            "; ".join(ways) + f"; checked on each checkpointing choice's first micro-batch "
            f"({steps} fake step{'s' if steps != 1 else ''} in all)"
        )


def _key(scheme: Scheme, cell: Cell, settings: SchemeSettings) -> tuple:
    """Where a cell's figures are kept: world size 1's are the unwrapped step's."""
    if cell.world_size == 1:
        return (UNWRAPPED, SETTINGS, cell)
    return (scheme.name, settings, cell)


def _as_lead(job: EngineJob) -> EngineJob:
    """``job`` checking everything it relies on itself."""
    return dataclasses.replace(job, lead=True, verify=True)


def engine_schemes(schemes) -> tuple[Scheme, ...]:
    """Those of ``schemes`` whose rows come from their own engine's fake steps."""
    return tuple(s for s in schemes if s in ENGINES)


def engine_jobs(schemes, cells, settings: SchemeSettings) -> list[EngineJob]:
    """The jobs that give every cell of ``cells`` for each engine scheme: per family,
    its smallest micro-batch's the lead; world size 1 once for them all."""
    micro_batches = sorted({c.micro_batch for c in cells})
    checkpointing = list(dict.fromkeys(c.checkpointing for c in cells))
    sizes = sorted({c.world_size for c in cells})
    above = tuple(ws for ws in sizes if ws > 1)
    families = []
    if 1 in sizes and engine_schemes(schemes):
        families.append((UNWRAPPED, (1,), SETTINGS))
    families += [(s.name, above, settings) for s in engine_schemes(schemes) if above]
    jobs = []
    for name, group, how in families:
        for n, ck in enumerate(checkpointing):
            for k, mb in enumerate(micro_batches):
                cell, lead = Cell.at(group[0], mb, ck), k == 0
                jobs.append(EngineJob(name, cell, group, how, lead, verify=lead and n == 0))
    return jobs


def measure_engine(loaded, opts, seq_len: int, job: EngineJob) -> EngineResult:
    from ..profiling.engine_step import Unwrapped
    from ..profiling.periodic import structure

    mb, ck = job.cell.choice
    cells = [Cell.at(ws, mb, ck) for ws in job.world_sizes]
    scheme = by_name(job.scheme) if job.scheme != UNWRAPPED else None
    if scheme is FSDP2:
        return _fsdp2(loaded, opts, seq_len, job, ENGINES[scheme](job.settings), cells)
    at = Cell.at(2 if scheme is DDP else 1, mb, ck)
    engine = ENGINES[scheme](job.settings) if scheme is DDP else Unwrapped()
    got = _engine_step(loaded, opts, seq_len, at, engine, 0, job.lead)
    found = figures_at(got.step.events, opts, cells)
    how = (
        "world size 1: the original model's own step, no engine, per micro-batch and checkpointing"
        if scheme is None
        else "world sizes above 1: per micro-batch and checkpointing, one step on rank 0 of "
        "2, the same on every rank and world size"
    )
    return EngineResult(
        {c: (RankFigures(0, c.world_size - 1, f),) for c, f in found.items()},
        1, how, structure(got.traced), got.sound,
    )  # fmt: skip


def _fsdp2(loaded, opts, seq_len: int, job: EngineJob, engine, cells) -> EngineResult:
    from ..profiling.periodic import structure
    from ..sources.adapted import adapt

    got = _engine_step(loaded, opts, seq_len, job.cell, engine, 0, job.lead)
    rows = _rows_of(adapt(loaded, opts.step).module)
    groups = {c: rank_groups(rows, c.world_size) for c in cells}
    ws0, sizes = job.cell.world_size, ", ".join(str(c.world_size) for c in cells)
    steps, rewrite, held = 1, True, None
    how = f"world sizes {sizes}: per micro-batch and checkpointing, one step on rank 0 of {ws0}"
    last = cells[-1]
    check = (last.world_size, groups[last][-1][0])
    if job.verify and check != (ws0, 0):
        rewrite = held = _rewrites(loaded, opts, seq_len, engine, got, last, check[1])
        steps += 1
        how += (
            f", rewritten to each world size and rank, checked against a trace on rank "
            f"{check[1]} of {check[0]}"
            if rewrite
            else f"; each world size and rank traced (rank {check[1]} of {check[0]} is "
            "not the rewritten step)"
        )
    traces = RankTraces(got.step) if rewrite else None
    relies = (
        rewrite and held is None and any(c.world_size != ws0 or len(groups[c]) > 1 for c in cells)
    )
    out = {}
    for cell in cells:
        ranks = []
        for first, end in groups[cell]:
            events, trace = got.step.events, traces.trace if traces else None
            if (cell.world_size, first) == (ws0, 0):
                pass
            elif rewrite:
                events = at_rank(got.step, cell.world_size, first)
                trace = traces.at(cell.world_size, first)
            else:
                events = _engine_step(loaded, opts, seq_len, cell, engine, first).step.events
                trace, steps = None, steps + 1
            ranks.append(RankFigures(first, end, run_figures(events, opts, cell, trace)))
        out[cell] = tuple(ranks)
    return EngineResult(out, steps, how, structure(got.traced), got.sound, held, relies)


def _rewrites(loaded, opts, seq_len: int, engine, got, cell: Cell, rank: int) -> bool:
    """Whether ``got``'s traced step rewritten to ``rank`` of ``cell``'s world size is
    the step traced there, event for event."""
    from ..profiling.engine_step import traced_step
    from ..profiling.periodic import canonical
    from ..profiling.shard_sizes import RecordedStep

    written = at_rank(got.traced, cell.world_size, rank)
    if written is None:
        return False
    traced = traced_step(loaded, step_options(opts, seq_len, cell), engine, rank, got.depth)
    return (
        canonical(RecordedStep(written, None))[:2]
        == canonical(RecordedStep(traced.events, None))[:2]
    )


def _engine_step(loaded, opts, seq_len: int, cell: Cell, engine, rank: int, checked=True):
    from ..profiling.engine_step import engine_step

    return engine_step(loaded, step_options(opts, seq_len, cell), engine, rank, checked)


def _rows_of(module) -> tuple[int, ...]:
    """Each parameter's dim-0 length: what FSDP2's split of it depends on."""
    return tuple(dict.fromkeys((tuple(p.shape) or (1,))[0] for p in module.parameters()))


def _fsdp2_engine(settings: SchemeSettings):
    from ..profiling.fsdp2_engine import Fsdp2Engine

    return Fsdp2Engine(reshard_after_forward=settings.reshard_after_forward)


def _ddp_engine(settings: SchemeSettings):
    from ..profiling.ddp_engine import DdpEngine

    return DdpEngine(gradient_as_bucket_view=settings.ddp_bucket_view)


# the schemes whose engine runs in the fake step, and how it is set up from the
# schemes' settings (the flat scheme's rows are the plan's own cells)
ENGINES = {FSDP2: _fsdp2_engine, DDP: _ddp_engine}
