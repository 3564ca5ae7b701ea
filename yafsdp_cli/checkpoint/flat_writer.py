"""Writing a flat checkpoint from byte streams: one file, or one file per rank.

The caller gives, for every buffer, the pieces of the whole logical buffer
(``padded_numel`` elements: entries and zero padding in flat order; ``file_ranges.py``:
file ranges, zeros, or bytes where no file lies behind them) and, for every kept
tensor, its pieces. ``write_flat`` routes each buffer's pieces to the rank files
(rank ``r`` gets bytes ``[r * S, (r + 1) * S)``, ``S`` the shard size in bytes),
cutting a range only where a shard ends, and copies every kept tensor into every
rank file, so each rank loads exactly one self-contained file.

With optimizer state (``optim``), each state buffer (``optim_state.py``) is one
more buffer to the writer: routed to the rank files with its parameters' shards.

Every file has the same tensors in the same data order (``format.data_order``),
and buffers are streamed in that order, so each file is appended front to back
while only one file handle is open at a time.

A rank of a running job writes its own file alone (``write_rank_file``: it holds
only its slices) and rank 0 the index from every rank's checksums (``write_index``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine import dtypes
from ..engine.layout import BufferLayout, Layout
from ..engine.records import TensorRecord
from ..errors import CheckpointError
from .file_ranges import Copier, Zeros, coalesce, size_of, split
from .format import (
    CHECKSUM_ALGO,
    FORMAT_VERSION,
    INDEX_FORMAT,
    INDEX_NAME,
    KEY_FORMAT,
    KEY_LAYOUT,
    KEY_LAYOUT_SUM,
    KEY_OPTIM,
    KEY_RANK,
    KEY_SHARDS,
    KEY_SOURCE,
    KEY_SOURCE_META,
    KEY_VERSION,
    KIND_FLAT,
    KIND_SHARD,
    STATE_VERSION,
    TensorSlot,
    checksum_of,
    data_order,
    layout_text,
    rank_file_name,
)
from .parallel_ranks import write_side_by_side, writers_for
from .results import BufferInfo, CheckpointInfo, Progress, WrittenFile
from .writer import FileWriter

if TYPE_CHECKING:  # a checkpoint without optimizer state never imports its parser
    from .optim_state import OptimState

Pieces = Iterable  # of copy.FileRange, copy.Zeros or bytes-like chunks


def stored_kept(layout: Layout) -> tuple[TensorRecord, ...]:
    """Kept tensors that are stored: non-persistent buffers are in no state dict."""
    return tuple(t for t in layout.kept if t.persistent)


def all_buffers(layout: Layout, optim: OptimState | None) -> tuple[BufferLayout, ...]:
    """The parameter buffers, then the optimizer's state buffers (if any)."""
    return layout.buffers + (optim.state_buffers(layout) if optim is not None else ())


def file_slots(layout: Layout, shards: int, optim: OptimState | None = None) -> list[TensorSlot]:
    """The tensors of each file (every rank file has the same), in data order."""
    slots = [
        TensorSlot(b.name, b.dtype, (b.padded_numel // shards,)) for b in all_buffers(layout, optim)
    ]
    slots += [TensorSlot(t.name, t.dtype, t.shape) for t in stored_kept(layout)]
    return data_order(slots)


def zeros(nbytes: int) -> Iterator[Zeros]:
    if nbytes > 0:
        yield Zeros(nbytes)


def base_metadata(
    layout: Layout, source: str, source_metadata: dict[str, str], optim: OptimState | None = None
) -> dict:
    text = layout_text(layout)
    extra = {KEY_OPTIM: optim.text()} if optim is not None else {}
    return {
        "format": "pt",
        KEY_VERSION: str(STATE_VERSION if optim is not None else FORMAT_VERSION),
        **extra,
        KEY_LAYOUT: text,
        KEY_LAYOUT_SUM: checksum_of(text.encode()),
        KEY_SOURCE: source,
        KEY_SOURCE_META: json.dumps(source_metadata, separators=(",", ":")),
    }


class _Counter:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress("writing", self.done, self.total)


def write_flat(
    target: Path,
    layout: Layout,
    *,
    sharded: bool,
    buffer_bytes: Callable[[BufferLayout], Pieces],
    kept_bytes: Callable[[TensorRecord], Pieces],
    source: str = "",
    source_metadata: dict[str, str] | None = None,
    progress: Progress | None = None,
    final: Path | None = None,
    copier: Copier | None = None,
    optim: OptimState | None = None,
    page_phase: int | None = None,
    ranged: bool = False,
    writer_threads: int | None = None,
) -> CheckpointInfo:
    """Write ``layout``'s checkpoint to ``target`` (a file, or an existing empty
    folder when ``sharded``); paths in the result use ``final`` (the name it will
    be renamed to). ``copier`` moves the file ranges (a new one if not given).
    With ``optim``, ``buffer_bytes`` is also asked for each state buffer.
    ``page_phase``: the source's (``writer.page_phase``), for page-aligned copies.
    ``ranged``: every piece is a file range or zeros, so rank files may be written
    side by side (``parallel_ranks``), by ``writer_threads`` threads (None: as many as
    ``parallel_ranks.writers_for`` gives; 1: one file after another, what
    ``python -m benchmarks.run two_writers`` sets the two against)."""
    final = final or target
    shards = layout.world_size if sharded else 1
    slots = file_slots(layout, shards, optim)
    meta = base_metadata(layout, source, dict(source_metadata or {}), optim)
    paths = [target / rank_file_name(r, shards) for r in range(shards)] if sharded else [target]
    writers: list[FileWriter] = []
    try:
        for r, path in enumerate(paths):
            extra = {KEY_FORMAT: KIND_SHARD, KEY_RANK: str(r), KEY_SHARDS: str(shards)}
            md = {**meta, **(extra if sharded else {KEY_FORMAT: KIND_FLAT})}
            writers.append(FileWriter(path, slots, md, page_phase=page_phase))
            writers[-1].suspend()
        feed = _Feed(copier or Copier(), _Switch(), None)
        buffers = {b.name: b for b in all_buffers(layout, optim)}
        threads = writers_for(len(writers)) if writer_threads is None else writer_threads
        threads = min(threads, len(writers))
        if ranged and threads > 1:
            fill = functools.partial(_fill_side_by_side, threads=threads)
        else:
            fill = _fill
        fill(writers, layout, buffers, slots, shards, buffer_bytes, kept_bytes, progress, feed)
        for w in writers:
            w.finish()
    finally:
        for w in writers:
            w.close()
    if sharded:
        write_index(target, layout, [_written(target, w, r) for r, w in enumerate(writers)], meta)
    return _info(final, layout, sharded, writers)


def _fill(writers, layout, buffers, slots, shards, buffer_bytes, kept_bytes, progress, feed):
    kept = {t.name: t for t in stored_kept(layout)}
    feed.tick = _Counter(progress, sum(w.nbytes - w.data_start for w in writers))
    for slot in slots:
        if slot.name in buffers:
            b = buffers[slot.name]
            size = b.padded_numel // shards * dtypes.itemsize(b.dtype)
            _scatter(writers, slot.name, size, coalesce(buffer_bytes(b)), feed)
        else:
            _broadcast(writers, slot.name, coalesce(kept_bytes(kept[slot.name])), feed)


def _fill_side_by_side(writers, layout, buffers, slots, shards, buffer_bytes, kept_bytes,
                       progress, feed, *, threads):  # fmt: skip
    """``_fill``'s routing, with each buffer's pieces listed first and the rank files
    then written by ``parallel_ranks.write_side_by_side``."""
    kept = {t.name: t for t in stored_kept(layout)}
    contents: list[list[tuple[str, list]]] = [[] for _ in writers]
    for slot in slots:
        if slot.name in buffers:
            b = buffers[slot.name]
            size = b.padded_numel // shards * dtypes.itemsize(b.dtype)
            cut = shard_pieces(slot.name, list(coalesce(buffer_bytes(b))), size, shards)
            for r, pieces in enumerate(cut):
                contents[r].append((slot.name, pieces))
        else:
            pieces = list(coalesce(kept_bytes(kept[slot.name])))
            for c in contents:
                c.append((slot.name, pieces))
    tick = _Counter(progress, sum(w.nbytes - w.data_start for w in writers))
    write_side_by_side(writers, contents, feed.copier, tick, threads)


@dataclass
class _Feed:
    """What moves pieces into the rank files: the copier, the open-file switch and
    the progress counter."""

    copier: Copier
    switch: _Switch
    tick: Callable[[int], None] | None

    def put(self, w: FileWriter, piece) -> None:
        self.switch(w).put(piece, self.copier, self.tick)


class _Switch:
    """Keeps at most one rank file open: the one being written."""

    def __init__(self):
        self.current: FileWriter | None = None

    def __call__(self, w: FileWriter) -> FileWriter:
        if self.current is not w and self.current is not None:
            self.current.suspend()
        self.current = w
        return w


def _scatter(writers, name: str, size: int, pieces: Pieces, feed: _Feed) -> None:
    """Bytes ``[r * size, (r + 1) * size)`` of the pieces go to ``writers[r]``."""
    r = 0
    feed.switch(writers[0]).begin(name)
    for rank, head in _cut(name, pieces, size, len(writers)):
        while r < rank:
            writers[r].end()
            r += 1
            feed.switch(writers[r]).begin(name)
        feed.put(writers[r], head)
    while True:
        writers[r].end()
        r += 1
        if r == len(writers):
            return
        feed.switch(writers[r]).begin(name)


def shard_pieces(name: str, pieces: list, size: int, shards: int) -> list[list]:
    """``pieces`` (a whole buffer) cut into ``shards`` lists of ``size`` bytes each."""
    out: list[list] = [[] for _ in range(shards)]
    for r, head in _cut(name, pieces, size, shards):
        out[r].append(head)
    return out


def _cut(name: str, pieces: Pieces, size: int, shards: int) -> Iterator[tuple[int, object]]:
    """``(rank, piece)``: the pieces of a whole buffer, cut where each rank's ``size``
    bytes end; the buffer must be ``shards * size`` bytes long."""
    r, filled = 0, 0
    for piece in pieces:
        while size_of(piece):
            if filled == size:
                r, filled = r + 1, 0
                if r == shards:
                    raise CheckpointError(f"{name}: the data is longer than the layout says")
            head, piece = split(piece, min(size_of(piece), size - filled))
            filled += size_of(head)
            yield r, head
    short = (shards - r) * size - filled
    if short:
        raise CheckpointError(f"{name}: the data ended {short} bytes short of the layout")


def _broadcast(writers, name: str, pieces: Pieces, feed: _Feed) -> None:
    for w in writers:
        feed.switch(w).begin(name)
    for piece in pieces:
        for w in writers:
            feed.put(w, piece)
    for w in writers:
        w.end()


def write_rank_file(
    folder: Path,
    layout: Layout,
    rank: int,
    pieces: Callable[[str], Pieces],
    meta: dict,
    optim: OptimState | None = None,
) -> WrittenFile:
    """Rank ``rank``'s file of a sharded set, alone (each rank of a running job
    writes its own): ``pieces(name)`` gives this rank's slice of each buffer and
    state buffer, and each kept tensor whole; ``meta`` is ``base_metadata``'s."""
    shards = layout.world_size
    extra = {KEY_FORMAT: KIND_SHARD, KEY_RANK: str(rank), KEY_SHARDS: str(shards)}
    slots = file_slots(layout, shards, optim)
    w = FileWriter(folder / rank_file_name(rank, shards), slots, {**meta, **extra})
    copier = Copier()
    try:
        for slot in w.slots:
            w.begin(slot.name)
            for piece in coalesce(pieces(slot.name)):
                w.put(piece, copier)
            w.end()
        w.finish()
    finally:
        w.close()
    return _written(folder, w, rank)


def _written(folder: Path, w: FileWriter, rank: int) -> WrittenFile:
    return WrittenFile(str(folder / w.path.name), rank, w.nbytes, dict(w.checksums))


def write_index(folder: Path, layout: Layout, files: list[WrittenFile], meta: dict) -> None:
    """``yafsdp.index.json`` of a sharded set whose rank files are ``files``."""
    index = {
        "format": INDEX_FORMAT,
        "version": int(meta[KEY_VERSION]),
        "world_size": layout.world_size,
        "checksum": CHECKSUM_ALGO,
        "layout_checksum": meta[KEY_LAYOUT_SUM],
        "source": meta[KEY_SOURCE],
        "source_metadata": json.loads(meta[KEY_SOURCE_META]),
        "ranks": [
            {"rank": r, "file": Path(f.path).name, "nbytes": f.nbytes, "checksums": f.checksums}
            for r, f in enumerate(files)
        ],
        "layout": json.loads(meta[KEY_LAYOUT]),
    }
    if KEY_OPTIM in meta:
        index["optimizer"] = meta[KEY_OPTIM]
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")


def _info(final: Path, layout: Layout, sharded: bool, writers) -> CheckpointInfo:
    files = tuple(
        WrittenFile(
            path=str(final / w.path.name) if sharded else str(final),
            rank=r if sharded else None,
            nbytes=w.nbytes,
            checksums=dict(w.checksums),
        )
        for r, w in enumerate(writers)
    )
    return CheckpointInfo(
        path=str(final),
        sharded=sharded,
        index=str(final / INDEX_NAME) if sharded else None,
        world_size=layout.world_size,
        align=layout.align.name,
        checksum=CHECKSUM_ALGO,
        files=files,
        buffers=tuple(buffer_info(b) for b in layout.buffers),
        kept=tuple(t.name for t in stored_kept(layout)),
        nbytes=sum(f.nbytes for f in files),
    )


def buffer_info(b: BufferLayout) -> BufferInfo:
    return BufferInfo(
        name=b.name,
        unit=b.unit,
        dtype=b.dtype,
        entries=len(b.entries),
        numel=b.numel,
        padded_numel=b.padded_numel,
        world_size=b.world_size,
        shard_numel=b.shard_numel,
        nbytes=b.nbytes,
    )
