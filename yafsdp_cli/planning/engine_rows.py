"""``plan --scheme``'s FSDP2 and DDP rows: each engine run in the fake step, every rank.

A scheme whose engine runs here (``Scheme.engine``, other than the flat one, whose
rows are the plan's own cells) has its rows from its own fake steps
(``profiling.engine_step``): FSDP2's ``fully_shard`` on every unit and the root,
DDP around the original model, under FakeTensorMode and a fake process group.

One ``EngineJob`` per scheme, micro-batch and checkpointing choice, a picklable
value like ``measure.Job``, so the plan's pool runs it beside the flat steps:

- FSDP2 (``rank_sizes``' note): one step traced on rank 0 at the job's smallest world
  size above 1, and its events rewritten to every other world size and rank; ranks
  that own the same rows of every dimension are one group (``rank_sizes.rank_groups``:
  most models have one per world size; 5 experts on 4 ranks have three), each
  replayed once. The rewrite is checked before it is used: the same step traced at the
  job's largest world size on its last rank must be the rewritten one, event for
  event; where it is not, every world size and rank group is traced. World size 1
  runs a job of its own (FSDP2 then all-gathers and reduces over one rank, a path
  of its own).
- DDP: every rank holds and runs the same, at every world size (nothing is sharded;
  its buckets are sized by the model alone): one step, at world size 2 (or 1 where
  the grid has nothing above), replayed once for every world size.

A cell's figures are ``measure.run_figures``' (phase peaks, what the model held at
each, the activations, the reserved peaks), per rank group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.step_schemes import SchemeSettings
from ..profiling.rank_sizes import at_rank, rank_groups
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
    line for the scheme's notes)."""

    cells: dict[Cell, tuple[RankFigures, ...]]
    steps: int
    how: str


@dataclass(frozen=True, slots=True)
class EngineJob:
    """One engine's fake steps for one micro-batch and checkpointing choice, at
    ``world_sizes``; ``cell``: the one traced (what ``pool`` orders jobs by)."""

    scheme: str  # ``Scheme.name``: a name crosses the pipe, the object is looked up
    cell: Cell
    world_sizes: tuple[int, ...]
    settings: SchemeSettings

    def run(self, loaded, opts, seq_len: int) -> EngineResult:
        return measure_engine(loaded, opts, seq_len, self)


class EngineRunner:
    """The engine schemes' figures of every cell a plan asks for; ``wanted`` and
    ``take`` put their jobs in the plan's pool, ``ranks`` runs what is missing here."""

    def __init__(self, loaded, opts, seq_len: int, origin=None):
        self.loaded, self.opts, self.seq_len, self.origin = loaded, opts, seq_len, origin
        self.steps = 0  # fake steps traced
        self._cells: dict[tuple, tuple[RankFigures, ...]] = {}
        self._how: dict[tuple, dict[str, int]] = {}  # how -> fake steps traced so

    def wanted(self, schemes, cells, settings: SchemeSettings) -> list[EngineJob]:
        """The jobs that give those of ``cells`` not measured yet, for each engine scheme
        of ``schemes``."""
        jobs = []
        for scheme in engine_schemes(schemes):
            todo = [c for c in cells if (scheme.name, settings, c) not in self._cells]
            jobs += engine_jobs((scheme,), todo, settings)
        return jobs

    def take(self, found: dict) -> None:
        """The results of ``pool.run_jobs`` (its engine jobs; others' ignored)."""
        for job, result in found.items():
            if isinstance(job, EngineJob):
                for cell, ranks in result.cells.items():
                    self._cells[(job.scheme, job.settings, cell)] = ranks
                how = self._how.setdefault((job.scheme, job.settings), {})
                how[result.how] = how.get(result.how, 0) + result.steps
                self.steps += result.steps

    def ranks(self, scheme: Scheme, cell: Cell, settings: SchemeSettings):
        """Each rank group's figures of ``scheme`` at ``cell``, measured now if not yet."""
        key = (scheme.name, settings, cell)
        if key not in self._cells:
            from .pool import run_jobs

            jobs = self.wanted((scheme,), [cell], settings)
            found, _ = run_jobs(
                jobs, loaded=self.loaded, opts=self.opts, seq_len=self.seq_len, origin=None
            )
            self.take(found)
        return self._cells[key]

    def how(self, scheme: Scheme, settings: SchemeSettings) -> str:
        """How ``scheme``'s rows were had, in words: each way, and its fake steps."""
        ways = self._how.get((scheme.name, settings), {})
        steps = sum(ways.values())
        return "; ".join(ways) + f" ({steps} fake step{'s' if steps != 1 else ''} in all)"


def engine_schemes(schemes) -> tuple[Scheme, ...]:
    """Those of ``schemes`` whose rows come from their own engine's fake steps."""
    return tuple(s for s in schemes if s in ENGINES)


def engine_jobs(schemes, cells, settings: SchemeSettings) -> list[EngineJob]:
    """The jobs that give every cell of ``cells`` for each engine scheme."""
    jobs = []
    choices = list(dict.fromkeys(c.choice for c in cells))
    sizes = sorted({c.world_size for c in cells})
    for scheme in engine_schemes(schemes):
        for mb, ck in choices:
            for group in _size_groups(scheme, sizes):
                jobs.append(EngineJob(scheme.name, Cell.at(group[0], mb, ck), group, settings))
    return jobs


def _size_groups(scheme: Scheme, sizes: list[int]) -> list[tuple[int, ...]]:
    """The world sizes one traced step gives: FSDP2's world size 1 apart from the rest;
    DDP's every one, traced at 2 where the grid goes above 1."""
    if scheme is DDP:
        return [tuple(sizes)] if sizes else []
    above = tuple(ws for ws in sizes if ws > 1)
    return [g for g in ((1,) if 1 in sizes else (), above) if g]


def measure_engine(loaded, opts, seq_len: int, job: EngineJob) -> EngineResult:
    scheme = by_name(job.scheme)
    engine = ENGINES[scheme](job.settings)
    mb, ck = job.cell.choice
    cells = [Cell.at(ws, mb, ck) for ws in job.world_sizes]
    if scheme is DDP:
        traced_at = Cell.at(2 if max(job.world_sizes) > 1 else 1, mb, ck)
        got = _engine_step(loaded, opts, seq_len, traced_at, engine, 0)
        found = figures_at(got.step.events, opts, cells)
        how = (
            f"per micro-batch and checkpointing, one step on rank 0 of {traced_at.world_size}, "
            "the same on every rank and world size"
        )
        return EngineResult(
            {c: (RankFigures(0, c.world_size - 1, f),) for c, f in found.items()}, 1, how
        )
    return _fsdp2(loaded, opts, seq_len, job, engine, cells)


def _fsdp2(loaded, opts, seq_len: int, job: EngineJob, engine, cells) -> EngineResult:
    from ..profiling.engine_step import traced_step
    from ..sources.adapted import adapt

    got = _engine_step(loaded, opts, seq_len, job.cell, engine, 0)
    rows = _rows_of(adapt(loaded, opts.step).module)
    groups = {c: rank_groups(rows, c.world_size) for c in cells}
    ws0 = job.cell.world_size
    last = cells[-1]
    check = (last.world_size, groups[last][-1][0])
    steps = 1
    how = f"world size {ws0}: one step per micro-batch and checkpointing"
    if ws0 > 1:
        sizes = ", ".join(str(c.world_size) for c in cells)
        how = f"world sizes {sizes}: per micro-batch and checkpointing, one step on rank 0 of {ws0}"
    rewrite = ws0 > 1
    if rewrite and check != (ws0, 0):
        traced = traced_step(loaded, step_options(opts, seq_len, last), engine, check[1], got.depth)
        steps += 1
        written = at_rank(got.traced, *check)
        rewrite = written is not None and _same(written, traced.events)
        how += (
            f", rewritten to each world size and rank, checked against a trace on rank "
            f"{check[1]} of {check[0]}"
            if rewrite
            else f"; each world size and rank traced (rank {check[1]} of {check[0]} is not "
            "the rewritten step)"
        )
    out = {}
    for cell in cells:
        ranks = []
        for first, end in groups[cell]:
            if (cell.world_size, first) == (ws0, 0):
                events = got.step.events
            elif rewrite:
                events = at_rank(got.step, cell.world_size, first)
            else:
                events = _engine_step(loaded, opts, seq_len, cell, engine, first).step.events
                steps += 1
            ranks.append(RankFigures(first, end, run_figures(events, opts, cell)))
        out[cell] = tuple(ranks)
    return EngineResult(out, steps, how)


def _engine_step(loaded, opts, seq_len: int, cell: Cell, engine, rank: int):
    from ..profiling.engine_step import engine_step

    return engine_step(loaded, step_options(opts, seq_len, cell), engine, rank)


def _same(written, traced) -> bool:
    """Whether two steps' events are the same, blocks numbered as first sized."""
    from ..profiling.periodic import canonical
    from ..profiling.shard_sizes import RecordedStep

    return canonical(RecordedStep(written, None))[:2] == canonical(RecordedStep(traced, None))[:2]


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
