"""A sharded step at another world size, from the events of one tracked step.

[Note: what the world size changes in a sharded step]
Rank 0 of a sharded flat model (``engine.sharded`` with ``LocalComm``) runs the same
ops in the same order at every world size above 1; what changes is the size of the
storages that hold a whole flat buffer's or one shard's worth of elements:

- the shards, and what the optimizer keeps per shard (float32 masters, its states);
- each unit's buffer while it is gathered, and its whole gradient;
- the gradient shard the reduce-scatter makes;
- after each backward: the masters' gradients (``--grad-dtype float32``); after the
  last: the optimizer's temporaries (foreach: one per shard) and the copies back into
  the shards.

Parameter starts depend only on the alignment and the dtype (``engine.layout``): only
a buffer's end padding depends on the world size. So the parameters' views, the
activations and every gradient of a parameter's own shape are the same at every
world size, and a buffer of ``end`` elements holds ``round_up(end, end_multiple(N))``
elements at world size N, a shard ``1/N`` of that.

``ShardTags`` names the blocks of the first kind as the step makes them: the
runtime's own tensors by name (``seed``, and ``ShardedFlat.on_reduced`` for the
gradients), and after backward every fresh 1-D output of an op whose matching input
(the same position of a foreach list) is a tagged tensor of the same shape.
``RecordedStep.at_world_size`` then rewrites the step's events with those blocks'
sizes at another world size: the events a step run at that world size records
(``tests/profiling/test_shard_sizes.py`` checks them event for event). ``plan`` takes its runs
at other world sizes so (``planning.measure``), one fake step per micro-batch and
checkpointing choice instead of one per world size.

A step is rewritten only where nothing argues against it, else ``at_world_size``
gives None and the step is run: no block was tagged twice differently, every tagged
block's size goes between zero and the one size its tag gives, and no untagged block
has as many bytes as a shard or a whole buffer of some dtype (an allocation the tags
missed would).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..engine import dtypes
from ..engine.layout import AlignSpec, round_up
from .rank_sizes import RankSizes
from .timeline import SIZE, StepEvents

ITEMSIZES = (1, 2, 4, 8)  # the bytes per element a missed allocation could have


@dataclass(frozen=True, slots=True)
class ShardSizes:
    """What the sizes at another world size need: per flat buffer its ``ends``
    (``(end, itemsize)``, which do not depend on the world size) and the alignment;
    per tagged block ``(buffer, whole, bytes per element)``; ``clean``: whether the
    step may be rewritten (see the note)."""

    world_size: int
    ends: tuple[tuple[int, int], ...]
    align: AlignSpec
    round_bytes: int
    tags: dict[int, tuple[int, bool, int]]
    clean: bool

    def numel(self, buffer: int, whole: bool, world_size: int) -> int:
        end, itemsize = self.ends[buffer]
        padded = round_up(end, self.align.end_multiple(world_size, itemsize))
        return padded if whole else padded // world_size

    def nbytes(self, block: int, world_size: int) -> int:
        buffer, whole, itemsize = self.tags[block]
        n = self.numel(buffer, whole, world_size) * itemsize
        return round_up(n, self.round_bytes) if n else 0


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """A tracked step's events; ``shards``: where it ran sharded, its tagged blocks;
    ``ranks``: where an FSDP2 rank ran it, its blocks sized by the world size and rank
    (``rank_sizes.RankSizes``)."""

    events: StepEvents
    shards: ShardSizes | None
    ranks: RankSizes | None = None

    @property
    def rewritable(self) -> bool:
        return self.shards is not None and self.shards.clean

    def at_world_size(self, world_size: int) -> StepEvents | None:
        """The events of the same step at ``world_size`` (above 1), or None where this
        step cannot be rewritten (see the note)."""
        sizes = self.shards
        if sizes is None or not sizes.clean or world_size < 2:
            return None
        if world_size == sizes.world_size:
            return self.events
        old = {i: sizes.nbytes(i, sizes.world_size) for i in sizes.tags}
        new = {i: sizes.nbytes(i, world_size) for i in sizes.tags}
        out = []
        for ev in self.events.events:
            if ev[0] == SIZE and ev[1] in old:
                delta, was = ev[2], old[ev[1]]
                if abs(delta) != was:
                    return None
                ev = (SIZE, ev[1], new[ev[1]] if delta > 0 else -new[ev[1]])
            out.append(ev)
        return dataclasses.replace(self.events, events=tuple(out))


class ShardTags:
    """Tags the blocks of a sharded step (``ShardedFlat``) whose size is a shard's or a
    whole buffer's (see the note); ``inheriting`` on: fresh outputs take their
    inputs' tags."""

    def __init__(self, tracker, sharded, round_bytes: int):
        self.tracker, self.round_bytes = tracker, round_bytes
        self.buffers = [b.layout for b in sharded.flat.buffers]
        self.align: AlignSpec = sharded.flat.layout.align
        self.world_size: int = sharded.comm.world_size
        self.tags: dict[int, tuple[int, bool, int]] = {}
        self.clash = False
        self.inheriting = False
        self.inherited_from = 0  # the first block made while inheriting

    def _numel(self, buffer: int, whole: bool) -> int:
        b = self.buffers[buffer]
        return b.padded_numel if whole else b.shard_numel

    def tag(self, t: torch.Tensor, buffer: int, whole: bool) -> None:
        """``t``'s storage holds buffer ``buffer`` whole, or its shard."""
        if t.numel() != self._numel(buffer, whole):
            self.clash = True  # not the size its name says: rewrite nothing
            return
        tag = (buffer, whole, t.element_size())
        if self.tags.setdefault(self.tracker.block(t), tag) != tag:
            self.clash = True

    def seed(self, sharded, masters, opt) -> None:
        """The runtime's own: shards, gathered buffers, masters, optimizer states."""
        index = {}
        for i, (b, shard) in enumerate(zip(sharded.flat.buffers, sharded.shards)):
            self.tag(shard, i, False)
            self.tag(b.param, i, True)
            index[id(shard)] = i
        for p, m in masters.pairs if masters is not None else ():
            if id(p) in index:
                index[id(m)] = index[id(p)]
                self.tag(m, index[id(p)], False)
        for p, state in opt.state.items() if opt is not None else ():
            for v in state.values():
                if id(p) in index and isinstance(v, torch.Tensor) and v.shape == p.shape:
                    self.tag(v, index[id(p)], False)

    def master_grads(self, masters) -> None:
        """The float32 gradients a micro-batch hands its masters (``--grad-dtype
        float32``): a shard's size, as their masters."""
        for _, m in masters.pairs:
            tag = self.tags.get(self.tracker.block_of(m))
            if tag is not None and m.grad is not None:
                self.tag(m.grad, tag[0], tag[1])

    def start_inheriting(self) -> None:
        """After backward: from here on, shard-sized tensors make shard-sized ones."""
        self.inheriting, self.inherited_from = True, len(self.tracker.first_nbytes)

    def reduced(self, buffer: int, full: torch.Tensor, part: torch.Tensor) -> None:
        """``ShardedFlat.on_reduced``: a unit's whole gradient and its shard."""
        self.tag(full, buffer, True)
        self.tag(part, buffer, False)

    def inherit(self, args, kwargs, outs: list[torch.Tensor]) -> None:
        """Fresh 1-D outputs of an op take the tag of the matching input (the same
        position of a foreach list, else any tensor argument) of the same shape."""
        fresh = [(k, t) for k, t in enumerate(outs) if t.dim() == 1 and self.tracker.is_new(t)]
        for k, t in fresh:
            for x in _matching(args, kwargs, k, len(outs)):
                tag = self.tags.get(self.tracker.block_of(x))
                if tag is not None and x.shape == t.shape and x.numel() == self._numel(*tag[:2]):
                    self.tag(t, tag[0], tag[1])
                    break

    def sizes(self) -> ShardSizes:
        """What was tagged, and whether the step may be rewritten."""
        numels = {self._numel(i, w) for i in range(len(self.buffers)) for w in (False, True)}
        suspect = {n * s for n in numels for s in ITEMSIZES}
        made = enumerate(self.tracker.first_nbytes[self.inherited_from :], self.inherited_from)
        missed = self.inheriting and any(n in suspect for i, n in made if i not in self.tags)
        return ShardSizes(
            world_size=self.world_size,
            ends=tuple((b.end, dtypes.itemsize(b.dtype)) for b in self.buffers),
            align=self.align,
            round_bytes=self.round_bytes,
            tags=dict(self.tags),
            clean=not (self.clash or missed),
        )


def _matching(args, kwargs, k: int, n: int):
    """The inputs output ``k`` of ``n`` may come from."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)) and len(a) == n and isinstance(a[k], torch.Tensor):
            yield a[k]
