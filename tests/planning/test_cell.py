"""A plan's cell: the grid's key, ordered as the rows are read, and carried whole."""

from __future__ import annotations

import itertools
import pickle

import pytest

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.mesh import Mesh
from yafsdp_cli.planning.cell import Cell, grid
from yafsdp_cli.planning.plan_report import PlanBreakdown, PlanRow

CHOICES = ("none", "non-reentrant", "reentrant")


def test_cells_sort_as_world_size_then_micro_batch_then_checkpointing():
    triples = list(itertools.product((16, 1, 2, 8), (4, 1, 2), CHOICES))
    cells = [Cell.at(*t) for t in reversed(triples)]
    assert [(c.world_size, *c.choice) for c in sorted(cells)] == sorted(triples)
    assert Cell.at(2, 8, "none") < Cell.at(4, 1, "none") <= Cell.at(4, 1, "none")
    assert Cell.at(4, 2, "reentrant") > Cell.at(4, 2, "none") >= Cell.at(4, 2, "none")


def test_a_cells_mesh_orders_it_last_within_one_world_size():
    hsdp = Cell(Mesh(dp_replicate=2, dp_shard=2), 1, "none")
    flat = Cell(Mesh.data_parallel(4), 1, "none")
    assert sorted([hsdp, flat]) == [flat, hsdp]  # dp_replicate 1 before 2
    assert Cell(Mesh.data_parallel(2), 8, "none") < hsdp


def test_a_cell_is_a_key_and_crosses_a_process_by_value():
    cell = Cell.at(8, 2, "non-reentrant")
    assert {cell: "x"}[Cell(Mesh(dp_shard=8), 2, "non-reentrant")] == "x"
    back = pickle.loads(pickle.dumps(cell))
    assert back == cell and hash(back) == hash(cell) and back.mesh.dp_shard == 8
    with pytest.raises(AttributeError):
        cell.micro_batch = 4  # type: ignore[misc]


def test_the_grid_lists_cells_as_a_plan_lists_its_rows():
    cells = grid(map(Mesh.data_parallel, (1, 2)), (1, 4), ("none", "reentrant"))
    assert [(c.world_size, *c.choice) for c in cells] == [
        (1, 1, "none"), (1, 4, "none"), (1, 1, "reentrant"), (1, 4, "reentrant"),
        (2, 1, "none"), (2, 4, "none"), (2, 1, "reentrant"), (2, 4, "reentrant"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "mesh", [Mesh(dp_replicate=2, dp_shard=2), Mesh(dp_shard=2, tp=2), Mesh(pp=2), Mesh(cp=2)]
)
def test_a_mesh_beyond_data_parallelism_is_refused_where_cells_are_made(mesh):
    with pytest.raises(YafsdpError, match=f"data parallelism alone.*{mesh.label}"):
        grid([Mesh.data_parallel(2), mesh], (1,), ("none",))


def test_a_row_gives_its_cell():
    zero = PlanBreakdown(*[0] * 9)
    row = PlanRow(4, 2, 64, "reentrant", 1, 1, zero, "backward", True, 1, 0, (), None)
    assert row.cell == Cell.at(4, 2, "reentrant")


def _row(ws: int, mb: int, needed: int, phase: str, frag: int, outside: int) -> PlanRow:
    from yafsdp_cli.memory.outside_allocator import OutsidePart

    zero = PlanBreakdown(*[0] * 9)
    parts = (OutsidePart("NCCL", outside, "test"),)
    peak = needed - frag - outside
    reserved = peak + frag
    return PlanRow(ws, mb, 64, "none", peak, needed, zero, phase, True, reserved, frag, parts, None)


def test_a_grid_that_is_not_monotone_says_which_part_moved():
    from yafsdp_cli.planning.fit_grid import monotonicity

    rows = [
        _row(1, 1, 1000, "optimizer", 300, 100),
        _row(1, 2, 900, "backward", 100, 100),  # less for more micro-batch
        _row(2, 1, 1100, "optimizer", 300, 250),  # more for more GPUs: NCCL grew
        _row(2, 2, 800, "backward", 100, 150),
    ]
    notes = monotonicity(rows)
    assert notes == (
        "not monotone (none): world size 1 micro-batch 2 needs less than world size 1 "
        "micro-batch 1 (900 B against 1000 B): the peak moved from the optimizer to the "
        "backward; allocated peak +100 B; fragmentation -200 B",
        "not monotone (none): world size 2 micro-batch 1 needs more than world size 1 "
        "micro-batch 1 (1100 B against 1000 B): allocated peak -50 B; beside the "
        "allocator +150 B",
        "not monotone (none): world size 2 micro-batch 2 needs less than world size 2 "
        "micro-batch 1 (800 B against 1100 B): the peak moved from the optimizer to the "
        "backward; fragmentation -200 B; beside the allocator -100 B",
    )
    steady = [_row(1, 1, 900, "backward", 0, 0), _row(1, 2, 1000, "backward", 0, 0)]
    assert monotonicity(steady + [_row(2, 1, 800, "backward", 0, 0)]) == ()
