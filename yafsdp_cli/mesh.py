"""The device mesh a plan's cell runs on: named dimensions, torchtitan's words.

A training job's ranks form a mesh of named dimensions: ``dp_replicate`` (data
parallel replicas: each holds the whole sharded state, HSDP's outer dimension),
``dp_shard`` (data parallel ranks a parameter is sharded over: FSDP, ZeRO-3 and the
flat scheme's shards), ``cp`` (context parallel), ``tp`` (tensor parallel) and
``pp`` (pipeline stages). ``ep`` (expert parallel) is not a dimension of its own:
as in torchtitan it is carved out of ``dp_shard * cp``, the experts of a layer
spread over ``ep`` of those ranks, so it must divide them and does not multiply
the world size.

Today's figures (the memory model, the fake runs, the step time) know one
dimension, ``dp_shard``: ``Mesh.data_parallel(n)`` is the mesh every plan runs on,
and a mesh with any other dimension above 1 is carried but refused where a plan's
cells are made (``planning.cell``). docs/design.md names what adding a dimension's
figures touches.

Torch-free and importing nothing but ``errors``, so every room may hold a mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .errors import YafsdpError

DIMENSIONS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass(frozen=True, slots=True)
class Mesh:
    """The size of each named dimension (1: not used)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            n = getattr(self, f.name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise YafsdpError(f"mesh dimension {f.name} must be a whole number >= 1, not {n!r}")
        if (self.dp_shard * self.cp) % self.ep:
            raise YafsdpError(
                f"mesh: ep={self.ep} must divide dp_shard * cp = {self.dp_shard * self.cp} "
                "(expert parallelism is carved out of those ranks)"
            )

    @classmethod
    def data_parallel(cls, world_size: int) -> Mesh:
        """``world_size`` ranks, each holding a shard of every parameter: the mesh of
        every plan today."""
        return cls(dp_shard=world_size)

    @property
    def world_size(self) -> int:
        """The ranks of the job: the product of the dimensions but ``ep`` (which is
        carved out of ``dp_shard * cp``)."""
        return math.prod(getattr(self, d) for d in DIMENSIONS if d != "ep")

    @property
    def shard(self) -> int:
        """The ranks a parameter is sharded over (its shard is 1/shard of it)."""
        return self.dp_shard

    @property
    def used(self) -> tuple[tuple[str, int], ...]:
        """The dimensions above 1, in ``DIMENSIONS`` order."""
        return tuple((d, getattr(self, d)) for d in DIMENSIONS if getattr(self, d) > 1)

    @property
    def data_parallel_only(self) -> bool:
        """Whether ``dp_shard`` is the only dimension used: what today's figures know."""
        return all(d == "dp_shard" for d, _ in self.used)

    @property
    def label(self) -> str:
        """Compact, for messages: ``dp_shard=8``, ``dp_replicate=2 x dp_shard=4``."""
        return " x ".join(f"{d}={n}" for d, n in self.used) or "1 rank"

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every dimension's size, in ``DIMENSIONS`` order."""
        return tuple(getattr(self, d) for d in DIMENSIONS)
