"""``reshard_checkpoint``: re-split a flat checkpoint for another world size.

No model is needed: the layout is re-planned from the stored entries with the
stored alignment preset for the new world size. Parameter starts depend only on
the preset and the dtype, so entries keep their offsets and only the end padding
changes; the data is copied by byte ranges, neighbouring entries as one range
(``copy.coalesce``), checksummed for the new files and for checking the input in
the same pass; ``verify`` then reads only what was not copied (padding, replicas).
Optimizer state buffers share their parameters' entries, so each is moved by the
same ranges as its parameter buffer, and the optimizer record is carried as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

from ..engine import dtypes
from ..engine.layout import BufferLayout, FlatEntry, Layout, check_layout, round_up
from ..errors import CheckpointError
from .file_ranges import Copier
from .flat_writer import write_flat, zeros
from .reader import FlatCheckpoint, open_flat
from .results import Progress, ReshardResult
from .writer import check_flat_name, check_output, page_phase, staged_output


def relayout(layout: Layout, world_size: int) -> Layout:
    """``layout`` re-planned for ``world_size`` ranks with the same alignment."""
    if world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1, got {world_size}")
    buffers = tuple(_rebuffer(b, layout, world_size) for b in layout.buffers)
    new = dataclasses.replace(layout, buffers=buffers, world_size=world_size)
    check_layout(new)
    return new


def _rebuffer(b: BufferLayout, layout: Layout, world_size: int) -> BufferLayout:
    isz = dtypes.itemsize(b.dtype)
    start_align = layout.align.start_alignment(isz)
    if start_align != b.start_align:
        raise CheckpointError(
            f"{b.name}: stored start alignment {b.start_align} is not what --align "
            f"{layout.align.name} gives ({start_align}); the layout was edited"
        )
    entries, pos = [], 0
    for e in b.entries:  # the planner's packing: each start rounded up to the alignment
        pos = round_up(pos, start_align)
        entries.append(dataclasses.replace(e, offset=pos))
        pos += e.numel
    end_multiple = layout.align.end_multiple(world_size, isz)
    return dataclasses.replace(
        b,
        entries=tuple(entries),
        end=pos,
        padded_numel=round_up(pos, end_multiple),
        world_size=world_size,
        end_multiple=end_multiple,
    )


def reshard_checkpoint(
    flat: str | Path,
    out: str | Path,
    *,
    world_size: int,
    sharded: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> ReshardResult:
    """Write ``flat`` (file, set folder or index) for ``world_size`` ranks: one
    file, or with ``sharded`` a folder of rank files and an index. The input is
    verified (checksums, padding) in the same pass before the output appears."""
    out = Path(out)
    check_flat_name(out, sharded=sharded)
    ckpt = open_flat(flat)
    new = relayout(ckpt.layout, world_size)
    check_output(out, inputs=list(ckpt.paths), force=force, folder=sharded)
    copier = Copier(record=True)
    old = {b.name: b for b in ckpt.all_buffers}
    with staged_output(out, folder=sharded, force=force) as staged:
        info = write_flat(
            staged.temp,
            new,
            sharded=sharded,
            buffer_bytes=lambda b: _buffer_bytes(ckpt, old[b.name], b),
            kept_bytes=lambda t: [ckpt.kept_range(t.name)],
            source=ckpt.source,
            source_metadata=ckpt.source_metadata,
            progress=progress,
            final=out,
            copier=copier,
            optim=ckpt.optim,
            page_phase=page_phase(ckpt.paths),
            ranged=True,
        )
        checked = ckpt.verify(progress, copier)  # reads only what was not copied
    return ReshardResult(
        input=str(ckpt.root),
        input_world_size=ckpt.layout.world_size,
        input_sharded=ckpt.sharded,
        checked=checked,
        checkpoint=info,
    )


def _buffer_bytes(ckpt: FlatCheckpoint, old: BufferLayout, new: BufferLayout) -> Iterator:
    isz = dtypes.itemsize(new.dtype)
    pos = 0
    for e_old, e_new in zip(old.entries, new.entries):
        yield from zeros((e_new.offset - pos) * isz)
        yield from _entry_bytes(ckpt, old, e_old, isz)
        pos = e_new.offset + e_new.numel
    yield from zeros((new.padded_numel - pos) * isz)


def _entry_bytes(ckpt: FlatCheckpoint, b: BufferLayout, e: FlatEntry, isz: int) -> Iterator:
    return ckpt.ranges(b, e.offset * isz, (e.offset + e.numel) * isz)
