"""A plan's cell: the mesh, the micro-batch and the checkpointing choice of one
configuration, the key of everything a plan computes per configuration (the fake
runs and their figures, the reserved peaks, the kernels counted, the rows).

A ``Cell`` is frozen and hashable (a dict key), pickles by value (it crosses the
process pool of ``pool`` as a run's key) and sorts as the grid is read: world size,
then micro-batch, then checkpointing (the meshes' own dimensions last, for meshes of
one world size). Rows keep their fields as the ``yafsdp.plan/1`` document names
them (``world_size``, ``micro_batch``, ``checkpointing``) and give their cell as a
property.

Today's figures know data parallelism alone (``Mesh.data_parallel``): ``grid``, where
the plan's cells are made, refuses a mesh with another dimension.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import YafsdpError
from ..mesh import Mesh


@dataclass(frozen=True, slots=True)
class Cell:
    mesh: Mesh
    micro_batch: int
    checkpointing: str

    @classmethod
    def at(cls, world_size: int, micro_batch: int, checkpointing: str) -> Cell:
        """The cell of a data-parallel plan of ``world_size`` ranks."""
        return cls(Mesh.data_parallel(world_size), micro_batch, checkpointing)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def choice(self) -> tuple[int, str]:
        """The micro-batch and checkpointing: what a rank's step does, whatever the mesh."""
        return self.micro_batch, self.checkpointing

    def _order(self) -> tuple:
        return (self.mesh.world_size, self.micro_batch, self.checkpointing, self.mesh.sizes)

    def __lt__(self, other: Cell) -> bool:
        return self._order() < other._order()

    def __le__(self, other: Cell) -> bool:
        return self._order() <= other._order()

    def __gt__(self, other: Cell) -> bool:
        return self._order() > other._order()

    def __ge__(self, other: Cell) -> bool:
        return self._order() >= other._order()


def grid(
    meshes: Iterable[Mesh], micro_batches: Iterable[int], checkpointing: Iterable[str]
) -> list[Cell]:
    """A plan's cells in the order its rows list them: per mesh, per checkpointing
    choice, per micro-batch. A mesh that is not data parallel alone is refused: the
    memory model, the fake runs and the step time know no other dimension yet."""
    meshes, micro_batches, checkpointing = list(meshes), list(micro_batches), list(checkpointing)
    for mesh in meshes:
        if not mesh.data_parallel_only:
            raise YafsdpError(
                f"plan figures data parallelism alone (dp_shard); the mesh {mesh.label} "
                "has another dimension"
            )
    return [Cell(m, mb, ck) for m in meshes for ck in checkpointing for mb in micro_batches]
