"""The flat-buffer layout: which parameter lives where, and which rank owns what.

[Note: Flat-buffer invariants]
A layout is a tuple of ``BufferLayout``s, one per (unit, dtype, trainable). In each:

- Order: entries appear in model order; offsets strictly follow that order.
- Slices: entry ``e`` occupies ``flat[e.offset : e.offset + e.numel]`` (end exclusive),
  viewed as ``e.shape``; ``e.numel == prod(e.shape)`` (0-d: 1, empty: 0).
- Alignment: ``e.offset % buffer.start_align == 0``; the gap before an aligned
  start is padding.
- No overlap: ``e.offset >= previous.offset + previous.numel``.
- Ends: ``buffer.end`` is one past the last entry; ``buffer.padded_numel`` is ``end``
  rounded up to ``buffer.end_multiple``, which ``world_size`` divides.
- Shards: rank ``r`` owns ``flat[r * s : (r + 1) * s]`` with
  ``s = padded_numel // world_size``; a parameter may span several ranks.
- Padding: every element not covered by an entry is zero (checked on data by the
  conversion engine and the checkpoint reader, not here).
- Coverage: every selected parameter is one entry, under its canonical name, with
  its tied owners as ``aliases``; no name appears twice across entries, aliases and
  the kept (unconverted) tensors.

Alignment presets (``--align``):

=========== ========================= ======================================
preset      parameter starts          padded numel a multiple of
=========== ========================= ======================================
yafsdp      anywhere (YaFSDP v2)      world_size * 8 (8-element shards)
fsdp        16 bytes (FSDP1)          world_size
megatron    64 elements               lcm(world_size, 128)
none        anywhere                  world_size
BYTES       BYTES bytes               world_size * (BYTES in elements)
=========== ========================= ======================================
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import LayoutError, YafsdpError
from ..numbers import MAX_ROUND_BYTES, shown
from . import dtypes
from .records import ModelSpec, TensorRecord
from .units import ROOT

FLAT_PREFIX = "__flat__"


@dataclass(frozen=True, slots=True)
class AlignSpec:
    """An alignment policy; ``name`` is a preset or the byte count as text."""

    name: str
    start_bytes: int = 1  # parameter starts are multiples of this many bytes
    start_elems: int = 1  # ... and of this many elements
    shard_elems: int = 1  # each shard is a multiple of this many elements
    end_lcm: int = 1  # padded numel is also a multiple of this

    def start_alignment(self, itemsize: int) -> int:
        """Elements between allowed parameter starts for a dtype of ``itemsize``."""
        by_bytes = math.lcm(self.start_bytes, itemsize) // itemsize
        return math.lcm(by_bytes, self.start_elems)

    def end_multiple(self, world_size: int, itemsize: int) -> int:
        shard = self.shard_elems
        if self.name.isdigit():  # an explicit byte alignment also aligns shard starts
            shard = self.start_alignment(itemsize)
        return math.lcm(world_size * shard, self.end_lcm)


ALIGN_PRESETS = {
    "yafsdp": AlignSpec("yafsdp", shard_elems=8),
    "fsdp": AlignSpec("fsdp", start_bytes=16),
    "megatron": AlignSpec("megatron", start_elems=64, end_lcm=128),
    "none": AlignSpec("none"),
}


def parse_align(text: str) -> AlignSpec:
    """``"yafsdp"``, ``"fsdp"``, ``"megatron"``, ``"none"`` or a byte count (``"128"``)."""
    if text in ALIGN_PRESETS:
        return ALIGN_PRESETS[text]
    # a byte count is at most what an allocator rounds to (1 GiB); a long one is not
    # converted (Python refuses more than 4300 digits)
    if text.isdigit() and len(text) < 20 and 1 <= int(text) <= MAX_ROUND_BYTES:
        return AlignSpec(text, start_bytes=int(text))
    presets = "|".join(ALIGN_PRESETS)
    raise YafsdpError(
        f"--align {shown(text)!r} is not {presets} or a number of bytes from 1 to "
        f"{MAX_ROUND_BYTES:,}"
    )


@dataclass(frozen=True, slots=True)
class FlatEntry:
    """One parameter inside a flat buffer: ``flat[offset : offset + numel].view(shape)``."""

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one entry that a rank owns.

    ``param.view(-1)[start:end]`` equals ``flat[flat_start : flat_start + end - start]``.
    """

    entry: str
    start: int
    end: int
    flat_start: int


@dataclass(frozen=True, slots=True)
class BufferLayout:
    name: str  # "__flat__.model.layers.0.bfloat16"; the root unit has no unit part
    unit: str  # "" for the root unit
    dtype: str
    requires_grad: bool
    entries: tuple[FlatEntry, ...]
    numel: int  # sum of entry numels
    end: int  # one past the last entry, interior padding included
    padded_numel: int
    world_size: int
    start_align: int  # elements
    end_multiple: int  # elements

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def nbytes(self) -> int:
        return self.padded_numel * dtypes.itemsize(self.dtype)

    def shard(self, rank: int) -> tuple[ShardPiece, ...]:
        """The pieces of parameters that ``rank`` owns, in flat order."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world size {self.world_size}")
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        starts = [e.offset for e in self.entries]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        pieces = []
        for e in self.entries[i:]:
            if e.offset >= hi:
                break
            a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
            if a < b:
                pieces.append(ShardPiece(e.name, a - e.offset, b - e.offset, a))
        return tuple(pieces)


@dataclass(frozen=True, slots=True)
class Layout:
    buffers: tuple[BufferLayout, ...]
    kept: tuple[TensorRecord, ...]  # stored as they are: unconverted params, module buffers
    world_size: int
    align: AlignSpec
    units: tuple[str, ...]
    # the units ``units.split_units`` made of modules outside the repeated blocks (an
    # embedding, a head): units for sharding, not blocks to checkpoint
    split: tuple[str, ...] = ()

    @property
    def blocks(self) -> tuple[str, ...]:
        """The units activation checkpointing wraps: every unit but the split ones."""
        return tuple(u for u in self.units if u not in self.split)

    @property
    def converted_numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    def entries(self) -> dict[str, tuple[BufferLayout, FlatEntry]]:
        """Every name (aliases too) -> (buffer, entry)."""
        return {n: (b, e) for b in self.buffers for e in b.entries for n in e.names}


def buffer_name(unit: str, dtype: str, requires_grad: bool = True) -> str:
    parts = [FLAT_PREFIX, *([unit] if unit else []), dtype]
    if not requires_grad:
        parts.append("frozen")
    return ".".join(parts)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Sharding(Protocol):
    """How far and how a layout's buffers are split: ``options.LayoutOptions`` (the
    engine cannot import the options room, which sits above it)."""

    world_size: int
    align: AlignSpec | str


@dataclass(frozen=True, slots=True)
class _OneRank:
    world_size: int = 1
    align: AlignSpec | str = "yafsdp"


def plan_layout(
    spec: ModelSpec,
    selected: Sequence[TensorRecord],
    unit_of: Mapping[str, str],
    sharding: Sharding | None = None,
    *,
    units: Sequence[str] = (),
    split: Sequence[str] = (),
) -> Layout:
    """Pack ``selected`` parameters into one buffer per (unit, dtype, trainable);
    ``split``: which of ``units`` are modules split out of the root (``Layout.split``).

    ``unit_of`` maps a canonical name to its unit (see ``units.assign_units``).
    Buffers appear in the order of their first parameter; the result is checked
    with ``check_layout``.
    """
    sharding = _OneRank() if sharding is None else sharding
    world_size, align = sharding.world_size, sharding.align
    if world_size < 1:
        raise YafsdpError(f"--world-size must be at least 1, got {world_size}")
    spec_align = parse_align(align) if isinstance(align, str) else align
    groups: dict[tuple[str, str, bool], list[TensorRecord]] = {}
    for t in selected:
        key = (unit_of.get(t.name, ROOT), t.dtype, t.requires_grad)
        groups.setdefault(key, []).append(t)
    buffers = tuple(
        _pack(unit, dtype, trainable, members, world_size, spec_align)
        for (unit, dtype, trainable), members in groups.items()
    )
    chosen = {t.name for t in selected}
    kept = tuple(t for t in spec.tensors if t.name not in chosen)
    layout = Layout(buffers, kept, world_size, spec_align, tuple(units), tuple(split))
    check_layout(layout)
    return layout


def _pack(
    unit: str,
    dtype: str,
    trainable: bool,
    members: Sequence[TensorRecord],
    world_size: int,
    align: AlignSpec,
) -> BufferLayout:
    size = dtypes.itemsize(dtype)
    start_align = align.start_alignment(size)
    end_multiple = align.end_multiple(world_size, size)
    entries, offset = [], 0
    for t in members:
        offset = round_up(offset, start_align)
        entries.append(FlatEntry(t.name, t.aliases, t.shape, dtype, offset, t.numel))
        offset += t.numel
    return BufferLayout(
        name=buffer_name(unit, dtype, trainable),
        unit=unit,
        dtype=dtype,
        requires_grad=trainable,
        entries=tuple(entries),
        numel=sum(t.numel for t in members),
        end=offset,
        padded_numel=round_up(offset, end_multiple),
        world_size=world_size,
        start_align=start_align,
        end_multiple=end_multiple,
    )


def check_layout(layout: Layout) -> None:
    """Raise ``LayoutError`` if any invariant of the note above is broken."""
    seen: dict[str, str] = {}

    def claim(name: str, where: str) -> None:
        if name in seen:
            raise LayoutError(f"{name!r} appears twice: in {seen[name]} and in {where}")
        seen[name] = where

    for t in layout.kept:
        for n in t.names:
            claim(n, "the kept tensors")
    for b in layout.buffers:
        claim(b.name, "the buffer names")
        _check_buffer(b, layout.world_size)
        for e in b.entries:
            for n in e.names:
                claim(n, b.name)


def _check_buffer(b: BufferLayout, world_size: int) -> None:
    if b.world_size != world_size:
        raise LayoutError(f"{b.name}: world size {b.world_size} != layout's {world_size}")
    prev_end = 0
    for e in b.entries:
        if e.numel != math.prod(e.shape):
            raise LayoutError(f"{b.name}: {e.name} numel {e.numel} != prod{list(e.shape)}")
        if e.dtype != b.dtype:
            raise LayoutError(f"{b.name}: {e.name} dtype {e.dtype} != buffer dtype {b.dtype}")
        if e.offset % b.start_align:
            raise LayoutError(
                f"{b.name}: {e.name} offset {e.offset} not a multiple of {b.start_align}"
            )
        if e.offset < prev_end:
            raise LayoutError(
                f"{b.name}: {e.name} starts at {e.offset}, overlapping up to {prev_end}"
            )
        prev_end = e.offset + e.numel
    if prev_end != b.end:
        raise LayoutError(f"{b.name}: entries end at {prev_end}, layout says {b.end}")
    if b.numel != sum(e.numel for e in b.entries):
        raise LayoutError(f"{b.name}: numel {b.numel} != sum of entries")
    if b.end_multiple % world_size or b.padded_numel != round_up(b.end, b.end_multiple):
        raise LayoutError(
            f"{b.name}: padded numel {b.padded_numel} is not {b.end} rounded up to a "
            f"multiple of {b.end_multiple} (world size {world_size})"
        )


LAYOUT_VERSION = 1


def layout_to_dict(layout: Layout) -> dict:
    """The layout as plain JSON-able data (``dataclasses.asdict``) with a version;
    ``split`` only where there is one, so a layout without one reads as it always has."""
    data = {"version": LAYOUT_VERSION, **dataclasses.asdict(layout)}
    if not data["split"]:
        del data["split"]
    return data


def layout_from_dict(data: dict) -> Layout:
    """Rebuild and check a layout from ``layout_to_dict`` output (e.g. a file's
    metadata); anything malformed is a ``LayoutError``."""
    if not isinstance(data, dict) or data.get("version") != LAYOUT_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise LayoutError(
            f"layout version {found!r} is not {LAYOUT_VERSION}; is this a yafsdp file?"
        )
    try:
        layout = Layout(
            buffers=tuple(_buffer_from_dict(b) for b in data["buffers"]),
            kept=tuple(_record_from_dict(t) for t in data["kept"]),
            world_size=int(data["world_size"]),
            align=AlignSpec(**data["align"]),
            units=tuple(str(u) for u in data["units"]),
            split=tuple(str(u) for u in data.get("split", ())),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"layout metadata is malformed ({type(exc).__name__}: {exc})") from None
    check_layout(layout)
    return layout


def _buffer_from_dict(b: dict) -> BufferLayout:
    entries = tuple(
        FlatEntry(
            name=str(e["name"]),
            aliases=tuple(str(a) for a in e["aliases"]),
            shape=tuple(int(d) for d in e["shape"]),
            dtype=dtypes.canonical(e["dtype"]),
            offset=int(e["offset"]),
            numel=int(e["numel"]),
        )
        for e in b["entries"]
    )
    ints = ("numel", "end", "padded_numel", "world_size", "start_align", "end_multiple")
    return BufferLayout(
        name=str(b["name"]),
        unit=str(b["unit"]),
        dtype=dtypes.canonical(b["dtype"]),
        requires_grad=bool(b["requires_grad"]),
        entries=entries,
        **{k: int(b[k]) for k in ints},
    )


def _record_from_dict(t: dict) -> TensorRecord:
    return TensorRecord(
        name=str(t["name"]),
        shape=tuple(int(d) for d in t["shape"]),
        dtype=dtypes.canonical(t["dtype"]),
        aliases=tuple(str(a) for a in t["aliases"]),
        is_param=bool(t["is_param"]),
        requires_grad=bool(t["requires_grad"]),
        persistent=bool(t["persistent"]),
        module_types=tuple(str(m) for m in t["module_types"]),
        kinds=tuple(str(k) for k in t["kinds"]),
    )
