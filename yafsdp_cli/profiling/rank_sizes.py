"""An FSDP2 step at another world size and rank, from the events of one tracked step.

[Note: what the world size and the rank change in an FSDP2 step]
A rank of ``fully_shard`` runs the same ops in the same order at every world size
above 1 and on every rank: each parameter is cut on dim 0 by ``torch.chunk`` rules
(``memory.fsdp2``), and what changes is the size of the storages that hold a
parameter's chunk, padded or not, or a unit's worth of them:

- ``PADDED``: the padded chunk, ``ceil(rows / N)`` rows, the same on every rank: a
  parameter's sharded storage; a unit's all-gather input, reduce-scatter output and
  its cast back to the sharded dtype (the gradients are views of it);
- ``GATHERED``: the padded chunk times ``N``: a parameter's all-gather output (the
  unsharded parameter views it), a unit's all-gather output and reduce-scatter
  input;
- ``OWN``: the rows the rank owns, ``clamp(rows - r * ceil(rows / N), 0, ceil(rows /
  N))``: what the optimizer keeps per parameter (its states) and makes from them
  (the foreach step's temporaries), which is why ranks differ where a dimension does
  not split evenly (5 experts on 2 ranks: 3 and 2; on 4 ranks: 2, 2, 1, 0).

Every other storage (activations, the unsharded gradients autograd makes, the
batch) is the same at every world size and rank. ``engines.fsdp2`` names the blocks
of the three kinds as the engine makes them (``SizeRule``: which kind, of which
parameters' shapes); ``RecordedStep.at_rank`` rewrites the step's events with their
sizes at another world size and rank. A rule holds shapes, not parameters, so the
periodic step (``periodic``) carries it to the layers it writes: a layer in the
same place of the period has the same shapes.

The rewrite is checked where it is used: ``planning.engine_rows`` traces the same
step at a second world size and rank, and rewrites nothing unless the rewritten
events are the traced ones, event for event.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.layout import round_up
from ..memory.caching_allocator import AllocTrace, TraceEvent
from .timeline import SIZE

PADDED, GATHERED, OWN = "padded", "gathered", "own"


@dataclass(frozen=True, slots=True)
class SizeRule:
    """A block of ``kind`` over parameters of ``terms`` ``(rows, elements per row)``
    (a unit's block sums its parameters'), ``itemsize`` bytes per element; ``made_by``:
    what made it (a unit's all-gather or reduce-scatter, a parameter's shard or
    state), which ``periodic`` ranks a layer's blocks by."""

    kind: str
    terms: tuple[tuple[int, int], ...]
    itemsize: int
    made_by: str = ""

    def numel(self, world_size: int, rank: int) -> int:
        return sum(_rows(self.kind, rows, world_size, rank) * per for rows, per in self.terms)

    def nbytes(self, world_size: int, rank: int, round_bytes: int) -> int:
        n = self.numel(world_size, rank) * self.itemsize
        return round_up(n, round_bytes) if n else 0


def _rows(kind: str, rows: int, world_size: int, rank: int) -> int:
    chunk = -(-rows // world_size)
    if kind == PADDED:
        return chunk
    if kind == GATHERED:
        return chunk * world_size
    return max(0, min(chunk, rows - rank * chunk))


def own_rows(rows: int, world_size: int, rank: int) -> int:
    """The rows of a dimension of ``rows`` that ``rank`` owns under ``torch.chunk``."""
    return _rows(OWN, rows, world_size, rank)


@dataclass(frozen=True, slots=True)
class RankSizes:
    """What ``at_rank`` needs: the world size and rank traced, the rounding, each
    named block's rule, and whether the step may be rewritten (every named block
    had its rule's size when it was made)."""

    world_size: int
    rank: int
    round_bytes: int
    rules: dict[int, SizeRule]
    clean: bool

    def nbytes(self, block: int, world_size: int, rank: int) -> int:
        return self.rules[block].nbytes(world_size, rank, self.round_bytes)

    def sizes_at(self, world_size: int, rank: int) -> dict[int, int]:
        """Every named block's bytes at ``world_size`` and ``rank`` (each rule sized
        once: the layers of a stack share theirs)."""
        by_rule: dict[SizeRule, int] = {}
        out = {}
        for block, rule in self.rules.items():
            n = by_rule.get(rule)
            if n is None:
                n = by_rule[rule] = rule.nbytes(world_size, rank, self.round_bytes)
            out[block] = n
        return out


def rank_groups(rows: tuple[int, ...], world_size: int) -> tuple[tuple[int, int], ...]:
    """The ranks of ``world_size`` that own as many rows of every dim 0 of ``rows`` (each
    parameter's) as each other, as ``(first, last)`` runs: one step rewritten per run
    gives every rank's figures."""
    signature = [
        tuple(own_rows(n, world_size, r) for n in dict.fromkeys(rows)) for r in range(world_size)
    ]
    runs: list[list[int]] = []
    for r, sig in enumerate(signature):
        if runs and signature[runs[-1][0]] == sig:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return tuple((a, b) for a, b in runs)


def at_rank(step, world_size: int, rank: int):
    """The events of ``step`` (a ``shard_sizes.RecordedStep`` of an FSDP2 rank) at
    ``world_size`` (above 1) and ``rank``, or None where it cannot be rewritten (see
    the note): a named block is only ever made or freed whole, so each of its events
    takes its size there; an event that would size nothing is dropped, as a step run
    there records none."""
    sizes = step.ranks
    if sizes is None or not sizes.clean or world_size < 2:
        return None
    if (world_size, rank) == (sizes.world_size, sizes.rank):
        return step.events
    old = sizes.sizes_at(sizes.world_size, sizes.rank)
    new = sizes.sizes_at(world_size, rank)
    out = []
    for ev in step.events.events:
        if ev[0] == SIZE and ev[1] in old:
            if abs(ev[2]) != old[ev[1]]:
                return None
            if not new[ev[1]]:
                continue
            ev = (SIZE, ev[1], new[ev[1]] if ev[2] > 0 else -new[ev[1]])
        out.append(ev)
    return dataclasses.replace(step.events, events=tuple(out))


class RankTraces:
    """``at_rank``'s allocation traces (what the caching allocator's model replays),
    each written from the step's own, made once: a named block's allocation takes its
    size at the world size and rank, and one of no bytes is left out with its free.
    The same trace as ``at_rank(...).alloc_trace()`` gives, block ids aside."""

    def __init__(self, step):
        self.step = step
        self.blocks: list[int] = []
        self.trace = step.events.alloc_trace(self.blocks)

    def at(self, world_size: int, rank: int) -> AllocTrace:
        new = self.step.ranks.sizes_at(world_size, rank)
        start, out, before = self.trace.step_start, [], 0
        for k, (e, b) in enumerate(zip(self.trace.events, self.blocks, strict=True)):
            n = new.get(b)
            if n is not None:
                if not n:
                    continue
                if e.size:
                    e = TraceEvent(e.block, n, e.stream)
            out.append(e)
            before += k < start
        return AllocTrace(tuple(out), before)
