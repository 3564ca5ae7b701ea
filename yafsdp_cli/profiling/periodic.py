"""A deep model's step from a short one: one period of the layer stack, repeated.

[Note: the periodic step]
A fake step costs Python per op, so per layer; its events (``timeline.StepEvents``)
are plain data. A transformer's step is a prefix (embedding), then each layer in
turn, then the head and loss; the backward visits the layers in reverse; the
optimizer takes each layer's parameters in order. So the step of a model of ``L``
layers is the step of a short model of the same prefix with one period of layers
repeated: its events where a middle period runs, its blocks (storages) renamed.

The tracker gives each block the layer it belongs to (``tracker``: the layer whose
forward or backward made it, else the layer of the op's matching input, so an
optimizer's temporaries follow their parameter; parameters, shards, masters and
states by their layer's parameters). Each event has a *context*: the layer running
(its forward or backward region) or, outside every layer, the layer of its block.

The short model keeps the first ``Stack.traced`` layers: the prefix, periods A, B
and C (C with the tail). ``repeat`` writes the step at depth ``L``, B written ``m``
times: a stretch of events whose context is in B is written once per copy (in
layer order; in reverse where the stretch runs backwards: the backward's), every
other event once (C's as the last copy's, after the copies). An event refers to a
block by its layer relative to the event's: a layer's first op freeing the
previous layer's output refers to one layer back in every copy. A block is known
by its layer in the deep model and its rank among that layer's blocks; its
attributes are those of the traced layer in the same place of the period.

Nothing of this is assumed. ``trace`` traces the short model *and* one a period
deeper, writes that deeper one from the short one, and compares the two event for
event (block numbering aside: it follows the order blocks are first seen), and the
sizes of every sharded block. Only where they are equal is the deep model's step
written; else the whole model is traced, and the report says why.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from .layer_stack import Stack
from .shard_sizes import RecordedStep
from .timeline import ENTER, EXIT, PHASE, SIZE, StepEvents
from .tracker import LayerRegions


class NotPeriodicError(Exception):
    """The step is not periodic where ``repeat`` needs it to be."""


@dataclass(frozen=True, slots=True)
class PeriodicTrace:
    """How a step was had: ``periodic`` (a short model traced, checked and repeated)
    or not, and why; the layers traced."""

    periodic: bool
    why: str
    traced_layers: tuple[int, ...] = ()  # depths traced (short, check) or (whole,)


def _stage(last: int | None, phase: str, depth: int) -> str:
    """Where a pass is relative to the stack: before it, between layers, past it."""
    if last is None:
        return "before"
    return "after" if last == (depth - 1 if phase == "forward" else 0) else "between"


def contexts(events: StepEvents, stack: Stack, depth: int) -> tuple[list[int | None], list[tuple]]:
    """Each event's context (see the note), and each block's kind: the phase it was
    first sized in, whether a layer was running then and where the pass was (before,
    between or past the stack of ``depth`` layers; a layer's blocks are ranked
    within their kind: the first and last layers also own blocks their neighbours
    outside the stack make, and those must not shift the ranks of the rest).

    Regions follow ``tracker.LayerRegions``. Between one layer's region and the next
    (a residual freed after a layer returns) the context is the layer that ran last;
    before the first of a pass, the block's own layer. Outside the passes (the
    optimizer step) it is the block's layer, except as ``_Loop`` says."""
    owners = events.owners or ()
    regions = LayerRegions()
    out: list[int | None] = []
    kinds: list[tuple] = [("unsized",)] * len(owners)
    seen: set[int] = set()
    phase = "setup"
    loop = _Loop()
    for ev in events.events:
        kind = ev[0]
        if kind == SIZE:
            owner = owners[ev[1]]
            first = ev[1] not in seen
            if first:
                seen.add(ev[1])
                stage = "inside" if regions.inside else _stage(regions.last, phase, depth)
                kinds[ev[1]] = (phase, stage)
            if phase in ("forward", "backward"):
                out.append(regions.context(owner))
            else:
                out.append(loop.context(ev[1], owner, first, ev[2]))
        elif kind == PHASE:
            regions.reset()
            loop = _Loop()
            phase = ev[1]
            out.append(None)
        else:
            name, backward = ev[1], ev[2]
            layer = stack.layer(name)
            is_layer = layer is not None and name == stack.layer_name(layer)
            if kind == ENTER and is_layer:
                regions.enter(layer, backward)
                out.append(layer)
            else:
                out.append(regions.context(layer))
                if kind == EXIT and is_layer:
                    regions.exit(layer, backward)
    return out, kinds


class _Loop:
    """Contexts outside the passes. A loop over parameters frees one parameter's
    temporaries while it makes the next one's: such a free belongs with the layer
    being made (one layer back, in every copy). A free is such when its block's
    layer is not the one being made, every block made since it belongs to one of
    the two, and one of those is still alive (the next parameter's work is under
    way); any other event belongs to its block's layer (a foreach op makes a block
    per layer in order, and its list frees them in reverse once all are made)."""

    NEAR = 64  # births after a block that are searched

    def __init__(self):
        self.cursor: int | None = None  # the layer whose births came last
        self.births: list[int] = []  # the layers of the blocks made, in order
        self.born: dict[int, int] = {}  # block -> its place in ``births``
        self.blocks: list[int] = []  # the blocks made, in order
        self.size: dict[int, int] = {}  # block -> its bytes now

    def context(self, block: int, owner: int | None, first: bool, delta: int) -> int | None:
        self.size[block] = self.size.get(block, 0) + delta
        if first:
            if owner is not None:
                self.born[block] = len(self.births)
                self.births.append(owner)
                self.blocks.append(block)
                self.cursor = owner
            return owner
        at = self.born.get(block)
        if owner is None or self.cursor is None or owner == self.cursor or at is None:
            return owner
        since = self.births[at + 1 :]
        if (
            len(since) <= self.NEAR
            and all(o in (owner, self.cursor) for o in since)
            and any(self.size.get(b, 0) > 0 for b in self.blocks[at + 1 :])
        ):
            return self.cursor
        return owner


class _Writer:
    """The deep step's events, blocks and shard tags as ``repeat`` writes them."""

    def __init__(self, step: RecordedStep, stack: Stack, depth: int):
        self.step, self.stack, self.depth = step, stack, depth
        self.src = step.events
        f, p = stack.prefix, stack.period
        self.copies = (depth - stack.traced) // p + 1
        self.lo, self.hi = f + p, f + 2 * p  # period B, the one repeated
        self.owners = self.src.owners
        self.ctx, self.kinds = contexts(self.src, stack, stack.traced)
        if step.ranks is not None:
            # an FSDP2 unit's buffers are ranked among its buffers: the last layer's
            # all-gather is made before the backward reaches any layer, the others'
            # inside the layer above, so it must not shift the ranks of the rest
            rules = step.ranks.rules
            self.kinds = [
                (*k, *((rules[b].kind, rules[b].made_by) if b in rules else ()))
                for b, k in enumerate(self.kinds)
            ]
        # (layer, kind) -> its blocks in order; a block is known by its rank there
        self.by_owner: dict[tuple, list[int]] = {}
        self.rank: list[int] = []
        for b, o in enumerate(self.owners):
            peers = self.by_owner.setdefault((o, self.kinds[b]), []) if o is not None else []
            self.rank.append(len(peers))
            peers.append(b)
        self.ids: dict[tuple, int] = {}
        self.events: list[tuple] = []
        self.roles: list = []
        self.born: list = []
        self.where: list = []
        self.stream: list = []
        self.new_owners: list = []
        self.tags: dict[int, tuple[int, bool, int]] = {}
        self.rules: dict = {}  # block -> its ``rank_sizes.SizeRule``, where it has one
        self.buffers: dict[tuple, int] = {}
        self.ends: list[tuple[int, int]] = []
        self._buffer_setup()

    # -- layers ------------------------------------------------------------------------

    def shift(self, t: int, j: int) -> int:
        """Where traced layer ``t`` is in the deep model, in copy ``j`` of B."""
        if t < self.lo:
            return t
        if t < self.hi:
            return t + j * self.stack.period
        return t + (self.copies - 1) * self.stack.period

    def traced_layer(self, s: int) -> int:
        """The traced layer in the same place of the period as deep layer ``s``."""
        p = self.stack.period
        if s < self.lo:
            return s
        if s < self.lo + self.copies * p:
            return self.lo + (s - self.lo) % p
        return s - (self.copies - 1) * p

    # -- blocks ------------------------------------------------------------------------

    def _buffer_setup(self) -> None:
        shards = self.step.shards
        self.buffer_owner: dict[int, int | None] = {}
        self.buffer_rank: dict[int, int] = {}
        self.buffers_of: dict[int | None, list[int]] = {}
        if shards is None:
            return
        for b, (buffer, _, _) in sorted(shards.tags.items()):
            # the first block tagged with a buffer is its shard: the buffer's layer
            self.buffer_owner.setdefault(buffer, self.owners[b])
        for buffer in sorted(self.buffer_owner):
            o = self.buffer_owner[buffer]
            peers = self.buffers_of.setdefault(o, [])
            self.buffer_rank[buffer] = len(peers)
            peers.append(buffer)

    def block(self, b: int, context: int | None, j: int) -> int:
        o = self.owners[b]
        if o is None or context is None:
            key: tuple = ("g", b)
            src, deep, moved = b, None, 0
        else:
            deep = self.shift(context, j) + (o - context)
            if not 0 <= deep < self.depth:
                raise NotPeriodicError(f"a block of layer {deep}, outside the model")
            t = self.traced_layer(deep)
            peers = self.by_owner.get((t, self.kinds[b]), ())
            if self.rank[b] >= len(peers):
                raise NotPeriodicError(f"layer {t} has fewer blocks than layer {o}")
            src, moved = peers[self.rank[b]], deep - t
            key = (deep, self.kinds[b], self.rank[b])
        i = self.ids.get(key)
        if i is not None:
            return i
        i = self.ids[key] = len(self.roles)
        ev = self.src
        if src != b and (ev.roles[src], ev.born[src], ev.stream[src]) != (
            ev.roles[b],
            ev.born[b],
            ev.stream[b],
        ):
            raise NotPeriodicError(
                f"layer {o}'s blocks differ from layer {self.traced_layer(deep)}'s"
            )
        self.roles.append(ev.roles[src])
        self.born.append(ev.born[src])
        self.stream.append(ev.stream[src])
        self.where.append(tuple(self.stack.renamed(n, moved) for n in ev.where[src]))
        self.new_owners.append(deep)
        shards = self.step.shards
        if shards is not None and src in shards.tags:
            buffer, whole, itemsize = shards.tags[src]
            self.tags[i] = (self._buffer(buffer, moved), whole, itemsize)
        ranks = self.step.ranks
        if ranks is not None and src in ranks.rules:
            self.rules[i] = ranks.rules[src]  # shapes: the same in each copy of a layer
        return i

    def _buffer(self, buffer: int, moved: int) -> int:
        o = self.buffer_owner[buffer]
        key = ("g", buffer) if o is None else (o + moved, self.buffer_rank[buffer])
        i = self.buffers.get(key)
        if i is None:
            i = self.buffers[key] = len(self.ends)
            self.ends.append(self.step.shards.ends[buffer])
        return i

    # -- events ------------------------------------------------------------------------

    def write(self) -> RecordedStep:
        events = self.src.events
        ctx = self.ctx
        n, i, phase = len(events), 0, "setup"
        while i < n:
            c = ctx[i]
            if c is None or not self.lo <= c < self.hi:
                if events[i][0] == PHASE:
                    phase = events[i][1]
                late = c is not None and c >= self.hi
                self.emit(events[i], c, self.copies - 1 if late else 0)
                i += 1
                continue
            start = i
            while i < n and ctx[i] is not None and self.lo <= ctx[i] < self.hi:
                i += 1
            order = range(self.copies)
            if self._backwards(ctx, start, i, phase):
                order = reversed(order)
            for j in order:
                for k in range(start, i):
                    self.emit(events[k], ctx[k], j)
        return self._result()

    def _backwards(self, ctx, start: int, end: int, phase: str) -> bool:
        """Whether a stretch of period B's events runs from the last layer down: by
        the layers of the events around it (C before it and A after: backwards), else
        by its own first and last layer, else by the phase."""
        before = next((c for c in reversed(ctx[max(0, start - 64) : start]) if c is not None), None)
        after = next((c for c in ctx[end : end + 64] if c is not None), None)
        if before is not None and after is not None:
            if before >= self.hi and after < self.lo:
                return True
            if before < self.lo and after >= self.hi:
                return False
        first, last = ctx[start], ctx[end - 1]
        if self.stack.period > 1 and first != last:
            return first > last
        return phase == "backward"

    def emit(self, ev: tuple, context: int | None, j: int) -> None:
        kind = ev[0]
        if kind == SIZE:
            self.events.append((SIZE, self.block(ev[1], context, j), ev[2]))
        elif kind in (ENTER, EXIT) and context is not None:
            moved = self.shift(context, j) - context
            self.events.append((kind, self.stack.renamed(ev[1], moved), ev[2]))
        else:
            self.events.append(ev)

    def _result(self) -> RecordedStep:
        events = StepEvents(
            tuple(self.events),
            tuple(self.roles),
            tuple(self.born),
            tuple(self.where),
            tuple(self.stream),
            self.src.ops,
            tuple(self.new_owners),
        )
        shards = self.step.shards
        if shards is not None:
            shards = dataclasses.replace(shards, ends=tuple(self.ends), tags=dict(self.tags))
        ranks = self.step.ranks
        if ranks is not None:
            ranks = dataclasses.replace(ranks, rules=dict(self.rules))
        return RecordedStep(events, shards, ranks)


def repeat(step: RecordedStep, stack: Stack, depth: int, ops_per_period: int = 0) -> RecordedStep:
    """The step of the model ``depth`` layers deep, from ``step`` of its first
    ``stack.traced`` layers (see the note); raises ``NotPeriodicError`` where the step is not
    periodic as it must be. ``ops_per_period``: the ops one period adds, for the
    count."""
    if step.events.owners is None:
        raise NotPeriodicError("the step was not traced with its layers")
    extra = depth - stack.traced
    if extra < 0 or extra % stack.period:
        raise NotPeriodicError(f"{depth} layers is not the traced depth and whole periods")
    out = _Writer(step, stack, depth).write()
    ops = step.events.ops + extra // stack.period * ops_per_period
    return dataclasses.replace(out, events=dataclasses.replace(out.events, ops=ops))


def canonical(step: RecordedStep) -> tuple:
    """What two traces of one step share: the events with the blocks numbered in the
    order they are first sized, each block's attributes, and each sharded block's
    size rule (its buffer's end and dtype, whole or shard; an FSDP2 block's
    ``rank_sizes.SizeRule``)."""
    ev = step.events
    order: dict[int, int] = {}
    out = []
    for e in ev.events:
        if e[0] == SIZE:
            i = order.setdefault(e[1], len(order))
            out.append((SIZE, i, e[2]))
        else:
            out.append(e)
    blocks = tuple(
        (ev.category(b), ev.born[b], ev.stream[b], ev.where[b])
        for b in sorted(order, key=order.get)
    )
    shards = step.shards
    tags = ()
    if shards is not None:
        tags = tuple(
            sorted(
                (order[b], shards.ends[buffer], whole, itemsize)
                for b, (buffer, whole, itemsize) in shards.tags.items()
                if b in order
            )
        )
        tags = (tags, shards.clean, shards.world_size, shards.align, shards.round_bytes)
    ranks = step.ranks
    if ranks is not None:
        rules = sorted((order[b], rule) for b, rule in ranks.rules.items() if b in order)
        tags = (tags, tuple(rules), ranks.clean, ranks.world_size, ranks.rank)
    return tuple(out), blocks, tags


def structure(step: RecordedStep) -> str:
    """A digest of what two steps of one model share when only their sizes differ (a
    micro-batch from another): ``canonical``'s events with each size change as its
    sign, each block's attributes, each named block's size rule. The same in every
    process (``hash`` of a string is not)."""
    events, blocks, tags = canonical(step)
    signs = tuple((e[0], e[1], e[2] > 0) if e[0] == SIZE else e for e in events)
    text = repr((signs, blocks, tags if step.ranks is not None else ()))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def first_difference(a: RecordedStep, b: RecordedStep) -> str:
    """Where two steps part, in words (for a report that had to trace the whole)."""
    ca, cb = canonical(a), canonical(b)
    for i, (x, y) in enumerate(zip(ca[0], cb[0])):
        if x != y:
            return f"event {i} of {len(cb[0])}: {_event(x)} where the traced step has {_event(y)}"
    if len(ca[0]) != len(cb[0]):
        return f"{len(ca[0])} events where the traced step has {len(cb[0])}"
    if ca[1] != cb[1]:
        return "the blocks' roles, phases or makers differ"
    return "the sharded blocks' sizes differ"


def _event(e: tuple) -> str:
    if e[0] == SIZE:
        return f"block {e[1]} {'+' if e[2] > 0 else ''}{e[2]} B"
    if e[0] == PHASE:
        return f"phase {e[1]}"
    return f"{'enter' if e[0] == ENTER else 'leave'} {e[1]}{' (backward)' if e[2] else ''}"


def matches(short: RecordedStep, checked: RecordedStep, stack: Stack) -> str | None:
    """None where ``short`` repeated to ``stack.checked`` layers is ``checked`` event
    for event; else why not, in words."""
    try:
        written = repeat(short, stack, stack.checked)
    except NotPeriodicError as exc:
        return str(exc)
    if canonical(written) == canonical(checked):
        return None
    return first_difference(written, checked)
