"""A step of N accumulated micro-batches, written from one that traced three.

[Note: the accumulated step]
With gradient accumulation (``--grad-accum N``) a step runs N micro-batches, a
forward and a backward each, then one optimizer step. The first micro-batch makes
what holds the gradients (per-parameter gradients, the flat gradient buffer, the
reduced shards, the float32 masters' gradients); every later one finds them held
through its forward and adds into them in its backward. So the second micro-batch
on are one computation on one state: each makes and frees the same storages, and
refers to the same storages that were there before it.

A fake step traces ``TRACED`` (3) micro-batches where N is larger, and writes the
others from the third: its events once more per micro-batch, the storages it made
renamed (``repeat``). Nothing of this is assumed: the third micro-batch must be the
second event for event (storages they make numbered in the order they are first
sized, each with the same role, phase, makers, stream, layer and shard size rule;
storages from before them by their own number), and the events after the last one
may refer to no storage the second made. Where that fails, every micro-batch is
traced, and the report says why. A real step, and ``--trace whole``, trace all N.

Each micro-batch runs the same batch with the same seed: memory follows shapes, and
a router that decides on data (a mixture of experts) then sends every micro-batch's
tokens alike, as the micro-batches of one real step would need to be for their
peaks to agree anyway.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .shard_sizes import RecordedStep
from .timeline import SIZE, StepEvents

TRACED = 3  # micro-batches a fake step traces at most before it writes the rest


@dataclass(frozen=True, slots=True)
class MicroTrace:
    """How a step's micro-batches were had: ``traced`` of ``total``, the rest written
    from the last traced (``repeated``), or all traced, and why."""

    total: int
    traced: int
    repeated: bool
    why: str


def traced_count(total: int, may_repeat: bool) -> int:
    """The micro-batches to trace of ``total``: ``TRACED`` where the rest may be written."""
    return min(total, TRACED) if may_repeat else total


def repeat(step: RecordedStep, marks: list[tuple[int, int]], total: int) -> RecordedStep | str:
    """The step of ``total`` micro-batches from ``step``, which traced ``TRACED`` of
    them (``marks``: ``(events, ops)`` where each began and where the last ended,
    ``StorageTracker.micro_marks``); or why it cannot be written so (see the note)."""
    if len(marks) != TRACED + 1 or total <= TRACED:
        return f"{len(marks) - 1} micro-batches were traced, not {TRACED}"
    ev = step.events
    (a0, _), (b0, ops_b0), (end, ops_end) = marks[1], marks[2], marks[3]
    first = _first_sized(ev.events)
    second, third = _made(first, a0, b0), _made(first, b0, end)
    why = _differs(step, (a0, b0, second), (b0, end, third))
    if why is not None:
        return f"the third micro-batch is not the second repeated: {why}"
    after = {e[1] for e in ev.events[end:] if e[0] == SIZE}
    if after & set(second):
        return "the step after the micro-batches frees a storage the second-to-last made"
    return _write(step, b0, end, third, total - TRACED, ops_end - ops_b0)


def _first_sized(events) -> dict[int, int]:
    """Each block -> the index of its first event."""
    first: dict[int, int] = {}
    for i, e in enumerate(events):
        if e[0] == SIZE:
            first.setdefault(e[1], i)
    return first


def _made(first: dict[int, int], start: int, end: int) -> list[int]:
    """The blocks first sized in ``events[start:end]``, in that order."""
    return sorted((b for b, i in first.items() if start <= i < end), key=first.get)


def _differs(step: RecordedStep, a: tuple, b: tuple) -> str | None:
    """Where two micro-batches' events part (``(start, end, blocks made)`` each), in
    words; None where they are one computation."""
    events = step.events.events
    (sa, ea, made_a), (sb, eb, made_b) = a, b
    if ea - sa != eb - sb:
        return f"{ea - sa} events where the third has {eb - sb}"
    if len(made_a) != len(made_b):
        return f"{len(made_a)} storages made where the third makes {len(made_b)}"
    local_a = {x: k for k, x in enumerate(made_a)}
    local_b = {x: k for k, x in enumerate(made_b)}
    for i in range(ea - sa):
        x, y = events[sa + i], events[sb + i]
        if x[0] == SIZE and y[0] == SIZE:
            x = (SIZE, ("made", local_a[x[1]]) if x[1] in local_a else x[1], x[2])
            y = (SIZE, ("made", local_b[y[1]]) if y[1] in local_b else y[1], y[2])
        if x != y:
            return f"event {i} of {ea - sa}"
    for k, (x, y) in enumerate(zip(made_a, made_b)):
        if _attributes(step, x) != _attributes(step, y):
            return f"storage {k} made differs in role, phase, makers, stream, layer or size rule"
    return None


def _attributes(step: RecordedStep, block: int) -> tuple:
    ev, shards = step.events, step.shards
    owner = ev.owners[block] if ev.owners is not None else None
    tag = shards.tags.get(block) if shards is not None else None
    return ev.roles[block], ev.born[block], ev.where[block], ev.stream[block], owner, tag


def _write(step: RecordedStep, start: int, end: int, made: list[int], copies: int, ops: int):
    """``step`` with ``events[start:end]`` written ``copies`` more times after
    ``end``, the blocks ``made`` there renamed in each copy (the events after refer
    to the last copy's)."""
    ev = step.events
    roles, born, where = list(ev.roles), list(ev.born), list(ev.where)
    stream = list(ev.stream)
    owners = list(ev.owners) if ev.owners is not None else None
    tags = dict(step.shards.tags) if step.shards is not None else None
    stretch = ev.events[start:end]
    out = list(ev.events[:end])
    rename: dict[int, int] = {}
    for _ in range(copies):
        rename = {}
        for b in made:
            rename[b] = len(roles)
            roles.append(ev.roles[b])
            born.append(ev.born[b])
            where.append(ev.where[b])
            stream.append(ev.stream[b])
            if owners is not None:
                owners.append(ev.owners[b])
            if tags is not None and b in step.shards.tags:
                tags[rename[b]] = step.shards.tags[b]
        out += [(SIZE, rename.get(e[1], e[1]), e[2]) if e[0] == SIZE else e for e in stretch]
    out += [(SIZE, rename.get(e[1], e[1]), e[2]) if e[0] == SIZE else e for e in ev.events[end:]]
    events = StepEvents(
        tuple(out),
        tuple(roles),
        tuple(born),
        tuple(where),
        tuple(stream),
        ev.ops + copies * ops,
        tuple(owners) if owners is not None else None,
    )
    shards = dataclasses.replace(step.shards, tags=tags) if step.shards is not None else None
    return RecordedStep(events, shards)
