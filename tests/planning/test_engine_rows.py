"""``plan --scheme``'s engine jobs (``engine_rows``): which steps are traced, and which
results stand (``[Note: one checked step per checkpointing choice]``).

A job that repeats or rewrites its step unchecked stands only on its lead's checks:
a planted digest that differs, or a rewrite that did not hold, leaves it out and
makes every job of its family check itself. The figures themselves are checked
against the real engines in ``test_plan_scheme_truth.py``.
"""

from __future__ import annotations

import dataclasses

from yafsdp_cli.memory.step_schemes import SchemeSettings
from yafsdp_cli.planning.cell import Cell
from yafsdp_cli.planning.engine_rows import (
    UNWRAPPED,
    EngineResult,
    EngineRunner,
    RankFigures,
    engine_jobs,
)
from yafsdp_cli.schemes import DDP, FLAT, FSDP2, ZERO3

SETTINGS = SchemeSettings()
CELLS = [
    Cell.at(ws, mb, ck) for ws in (1, 2, 4) for mb in (1, 2, 4) for ck in ("none", "non-reentrant")
]


def _result(job, digest="d", sound=True, rewrites=None, relies=False) -> EngineResult:
    mb, ck = job.cell.choice
    cells = {
        Cell.at(ws, mb, ck): (RankFigures(0, ws - 1, {"forward": mb}),) for ws in job.world_sizes
    }
    return EngineResult(cells, 1, "how", digest, sound, rewrites, relies)


def _runner() -> EngineRunner:
    return EngineRunner(loaded=None, opts=None, seq_len=16)


def test_the_jobs_one_per_engine_family_and_micro_batch_world_size_1_once():
    jobs = engine_jobs((FLAT, FSDP2, ZERO3, DDP), CELLS, SETTINGS)
    names = {j.scheme for j in jobs}
    assert names == {UNWRAPPED, FSDP2.name, DDP.name}  # flat and zero3 run no engine
    assert len(jobs) == 3 * 3 * 2  # (unwrapped, fsdp2, ddp) x micro-batches x checkpointing
    for j in jobs:
        assert j.world_sizes == ((1,) if j.scheme == UNWRAPPED else (2, 4))
        assert j.cell.world_size == j.world_sizes[0]
        assert j.lead == (j.cell.micro_batch == 1)  # the smallest micro-batch leads
    verifying = [j for j in jobs if j.verify]
    # one per scheme: the first checkpointing choice's lead
    assert {(j.scheme, j.cell.checkpointing) for j in verifying} == {
        (UNWRAPPED, "none"), (FSDP2.name, "none"), (DDP.name, "none"),
    }  # fmt: skip


def test_followers_stand_on_their_leads_checks():
    runner = _runner()
    jobs = engine_jobs((DDP,), [c for c in CELLS if c.world_size > 1], SETTINGS)
    found = {j: _result(j) for j in jobs}
    runner.take(found)
    assert runner.wanted((DDP,), [c for c in CELLS if c.world_size > 1], SETTINGS) == []
    assert runner.ranks(DDP, Cell.at(4, 4, "non-reentrant"), SETTINGS)[0].figures == {"forward": 4}


def test_a_follower_whose_events_are_not_its_leads_is_traced_again_checked():
    runner = _runner()
    cells = [c for c in CELLS if c.world_size > 1]
    jobs = engine_jobs((DDP,), cells, SETTINGS)
    odd = next(j for j in jobs if not j.lead and j.cell.checkpointing == "non-reentrant")
    runner.take({j: _result(j, digest="planted" if j is odd else "d") for j in jobs})
    again = runner.wanted((DDP,), cells, SETTINGS)
    assert [(j.cell, j.lead) for j in again] == [(odd.cell, True)]  # it checks itself now
    # the lead whose check failed leaves every follower of its family out
    runner = _runner()
    unsound = {j: _result(j, sound=not (j.lead and j.cell.checkpointing == "none")) for j in jobs}
    runner.take(unsound)
    again = runner.wanted((DDP,), cells, SETTINGS)
    assert {j.cell.micro_batch for j in again} == {2, 4}
    assert {j.cell.checkpointing for j in again} == {"none"} and all(j.lead for j in again)


def test_a_rewrite_that_did_not_hold_leaves_out_every_job_that_relies_on_it():
    runner = _runner()
    cells = [c for c in CELLS if c.world_size > 1]
    jobs = engine_jobs((FSDP2,), cells, SETTINGS)
    found = {j: _result(j, rewrites=False) if j.verify else _result(j, relies=True) for j in jobs}
    runner.take(found)
    again = runner.wanted((FSDP2,), cells, SETTINGS)
    assert len(again) == len(jobs) - 1  # all but the job that checked (and traced each)
    assert all(j.lead and j.verify for j in again)
    # where the rewrite held, the others stand, and later jobs need not check it again
    runner = _runner()
    runner.take(
        {j: _result(j, rewrites=True) if j.verify else _result(j, relies=True) for j in jobs}
    )
    assert runner.wanted((FSDP2,), cells, SETTINGS) == []
    later = runner.wanted((FSDP2,), [Cell.at(2, 8, "none")], SETTINGS)
    assert [dataclasses.astuple(j)[-2:] for j in later] == [(True, False)]  # lead, no verify


def test_world_size_1_is_one_step_for_both_engines():
    runner = _runner()
    cells = [c for c in CELLS if c.world_size == 1]
    jobs = engine_jobs((FSDP2, DDP), cells, SETTINGS)
    assert {j.scheme for j in jobs} == {UNWRAPPED}
    runner.take({j: _result(j) for j in jobs})
    for scheme in (FSDP2, DDP):
        assert runner.ranks(scheme, Cell.at(1, 2, "none"), SETTINGS)[0].figures == {"forward": 2}
