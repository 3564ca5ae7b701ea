"""Opening and checking flat checkpoints: one file, or a folder of rank files.

``open_flat`` checks structure from the headers alone (every header through the
defensive safetensors parser, the layout against its checksum and invariants,
each file's tensors against the layout, each rank file against the index);
``FlatCheckpoint.verify`` then checks every byte once: checksums and zero padding
(``integrity.py``; bytes a copier has just copied are not read twice). Nothing is
trusted before both have passed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine import dtypes
from ..engine.layout import BufferLayout, Layout
from ..errors import CheckpointError
from ..fileio import read_chunks as _read_file_chunks
from ..fileio import read_json, require_inside
from ..sources.safetensors_file import StHeader, read_header
from .file_ranges import Copier, FileRange
from .flat_writer import all_buffers, file_slots
from .format import (
    INDEX_FORMAT,
    INDEX_NAME,
    KEY_CHECKSUMS,
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
    READ_VERSIONS,
    STATE_VERSION,
    STREAM_CHUNK,
    TensorSlot,
    algo_of,
    checksum_of,
    int_field,
    json_field,
    layout_text,
    parse_layout,
    rank_file_name,
)
from .integrity import StoredTensor, Ticks, digest_of, padding
from .results import Progress

if TYPE_CHECKING:  # parsed only where a checkpoint holds optimizer state
    from .optim_state import OptimState


@dataclass(frozen=True)
class FlatCheckpoint:
    root: Path  # the file, or the folder of a sharded set
    layout: Layout
    files: tuple[dict[str, StoredTensor], ...]  # per rank file (one for a single file)
    file_paths: tuple[Path, ...]  # the rank files in rank order (or the one file)
    index: Path | None = None
    source_metadata: dict[str, str] = field(default_factory=dict)
    source: str = ""  # the original source's file name, as recorded
    optim: OptimState | None = None  # version 2: the optimizer record

    @property
    def all_buffers(self) -> tuple[BufferLayout, ...]:
        """Parameter buffers, then state buffers."""
        return all_buffers(self.layout, self.optim)

    @property
    def sharded(self) -> bool:
        return self.index is not None

    @property
    def shards(self) -> int:
        return len(self.files)

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every file read (rank files, then the index)."""
        return self.file_paths + ((self.index,) if self.index else ())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for f in self.files for t in f.values())

    def ranges(self, b: BufferLayout, start: int, stop: int) -> Iterator[FileRange]:
        """Where bytes ``[start, stop)`` of logical buffer ``b`` lie (one range per
        rank file they touch)."""
        size = b.padded_numel // self.shards * dtypes.itemsize(b.dtype)
        while start < stop:
            r, local = divmod(start, size)
            n = min(stop - start, size - local)
            t = self.files[r][b.name]
            yield FileRange(t.path, t.offset + local, n)
            start += n

    def read_range(self, b: BufferLayout, start: int, stop: int) -> Iterator[memoryview]:
        """Bytes ``[start, stop)`` of logical buffer ``b`` (across rank files)."""
        for fr in self.ranges(b, start, stop):
            yield from read_chunks(fr.path, fr.offset, fr.nbytes)

    def kept_range(self, name: str) -> FileRange:
        t = self.files[0][name]
        return FileRange(t.path, t.offset, t.nbytes)

    def kept_bytes(self, name: str) -> Iterator[memoryview]:
        t = self.files[0][name]
        return read_chunks(t.path, t.offset, t.nbytes)

    def verify(
        self,
        progress: Progress | None = None,
        copier: Copier | None = None,
        *,
        ranks: Iterable[int] | None = None,
    ) -> int:
        """Read every stored tensor: checksum, and zero padding in buffers (holes of
        a sparse file are zeros by definition, so they are not read). Ranges that
        ``copier`` already copied (its ledger has their CRC-32) are not read again.
        ``ranks`` limits the check to those rank files (a training rank reads its
        own file alone). Returns how many tensors were checked; raises
        ``CheckpointError``."""
        buffers = {b.name: b for b in self.all_buffers}
        copier = copier or Copier()
        chosen = range(self.shards) if ranks is None else list(ranks)
        tick = Ticks(progress, sum(t.nbytes for r in chosen for t in self.files[r].values()))
        count = 0
        for r in chosen:
            tensors = self.files[r]
            for t in sorted(tensors.values(), key=lambda t: t.offset):
                pads = padding(buffers[t.name], r, self.shards) if t.name in buffers else []
                found = digest_of(t, pads, copier, tick)
                if found != t.checksum:
                    what = "buffer" if t.name in buffers else "tensor"
                    raise CheckpointError(
                        f"{t.path}: {what} {t.name!r} fails its checksum (stored {t.checksum}, "
                        f"the data gives {found}); the file is corrupt or was modified: "
                        "convert it again from the source"
                    )
                count += 1
        return count


def read_chunks(
    path: Path, offset: int, nbytes: int, chunk: int = STREAM_CHUNK
) -> Iterator[memoryview]:
    """``nbytes`` bytes of ``path`` from ``offset``; each chunk valid until the next."""
    return _read_file_chunks(path, offset, nbytes, chunk, error=CheckpointError)


@dataclass(frozen=True, slots=True)
class StateDictItem:
    """One tensor of a restored state dict and where its bytes are."""

    slot: TensorSlot
    aliases: tuple[str, ...]
    ranges: Callable[[], Iterable[FileRange]]  # -> where its bytes lie

    def read(self) -> Iterator[memoryview]:
        for fr in self.ranges():
            yield from read_chunks(fr.path, fr.offset, fr.nbytes)


# ------------------------------------------------------------------ opening


def open_flat(path: str | Path) -> FlatCheckpoint:
    """A flat file, a sharded set's folder, or its ``yafsdp.index.json``; checked
    from the headers (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        require_inside(path, path / INDEX_NAME, error=CheckpointError)
        if not (path / INDEX_NAME).is_file():
            raise not_flat(path, f"a folder without {INDEX_NAME}")
        return _open_set(path / INDEX_NAME)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.name.endswith(".json"):
        return _open_set(path)
    return _open_file(path)


def not_flat(path: Path, why: str) -> CheckpointError:
    """The one error for an input that ``yafsdp convert`` did not write: it says what
    the input is and where such a file goes instead (a state dict given to restore is
    the common mix-up)."""
    return CheckpointError(
        f"{path} is not a yafsdp flat checkpoint ({why}); restore and reshard take what "
        "`yafsdp convert` writes: a .safetensors file with yafsdp metadata, or a --sharded "
        "folder; to read a state dict, use inspect or convert"
    )


# torch.save writes a zip archive, or before torch 1.6 a pickle (protocol 2 and up)
ZIP_MAGIC = b"PK\x03\x04"
PICKLE_PROTOCOLS = range(2, 6)


def _plainly_not_safetensors(path: Path) -> str | None:
    """What ``path`` is, when its first bytes show it is no safetensors file at all (a
    safetensors header is JSON, so byte 8 opens it with ``{``); None where it may be
    one, so that a truncated or damaged flat checkpoint is named by the header parser."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return None  # read_header names the failure
    if len(head) < 9 or head[8:9] == b"{":
        return None
    if head.startswith(ZIP_MAGIC):
        return "a zip archive, as torch.save writes"
    if head[0] == 0x80 and head[1] in PICKLE_PROTOCOLS:
        return "a pickle, as torch.save writes"
    return "not a safetensors file"


def _open_file(path: Path) -> FlatCheckpoint:
    if path.is_file() and (what := _plainly_not_safetensors(path)) is not None:
        raise not_flat(path, what)
    header = read_header(path)
    md = header.metadata
    kind = md.get(KEY_FORMAT)
    if kind == KIND_SHARD:
        raise CheckpointError(
            f"{path} is rank {md.get(KEY_RANK)} of a sharded set of {md.get(KEY_SHARDS)}; "
            f"give its folder (or its {INDEX_NAME}) instead"
        )
    if kind != KIND_FLAT:
        raise not_flat(path, f"its metadata has no {KEY_FORMAT!r} = {KIND_FLAT!r}")
    _check_version(md.get(KEY_VERSION), path)
    layout = parse_layout(_need(md, KEY_LAYOUT, path), str(path), _need(md, KEY_LAYOUT_SUM, path))
    optim = _optim(md.get(KEY_OPTIM), md.get(KEY_VERSION), str(path), layout)
    sums = json_field(md, KEY_CHECKSUMS, str(path), dict)
    tensors = _match(header, layout, 1, sums, optim)
    return FlatCheckpoint(
        path,
        layout,
        (tensors,),
        (path,),
        None,
        _source_meta(md, path),
        md.get(KEY_SOURCE, ""),
        optim,
    )


def _optim(text, version, where: str, layout: Layout) -> OptimState | None:
    """The optimizer record: present exactly in a version 2 checkpoint."""
    if (text is not None) != (str(version) == str(STATE_VERSION)):
        raise CheckpointError(
            f"{where}: version {version} with{'' if text is not None else 'out'} an optimizer "
            "record; the metadata is damaged"
        )
    if text is None:
        return None
    from .optim_state import parse_optim

    return parse_optim(str(text), where, layout)


def _need(md: dict[str, str], key: str, path: Path) -> str:
    if key not in md:
        raise CheckpointError(f"{path}: metadata has no {key!r}; the file is damaged")
    return md[key]


def _check_version(found, where) -> None:
    if str(found) not in map(str, READ_VERSIONS):
        raise CheckpointError(
            f"{where}: flat checkpoint format version {found!r}; this yafsdp reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}"
        )


def _source_meta(md: dict[str, str], path: Path) -> dict[str, str]:
    if KEY_SOURCE_META not in md:
        return {}
    value = json_field(md, KEY_SOURCE_META, str(path), dict)
    return {str(k): str(v) for k, v in value.items()}


def _match(
    header: StHeader, layout: Layout, shards: int, sums: dict, optim: OptimState | None
) -> dict[str, StoredTensor]:
    """The file's tensors, which must be exactly the layout's for ``shards`` files."""
    path = header.path
    found = {e.name: e for e in header.entries}
    out = {}
    buffers = {b.name for b in all_buffers(layout, optim)}
    for slot in file_slots(layout, shards, optim):
        e = found.pop(slot.name, None)
        what = "buffer" if slot.name in buffers else "kept tensor"
        if e is None:
            raise CheckpointError(f"{path}: {what} {slot.name!r} of the layout is missing")
        if (e.dtype, e.shape) != (slot.dtype, slot.shape):
            raise CheckpointError(
                f"{path}: {what} {slot.name!r} is {e.dtype}{list(e.shape)} in the header, "
                f"but the layout says {slot.dtype}{list(slot.shape)}"
            )
        digest = sums.get(slot.name)
        if not isinstance(digest, str):
            raise CheckpointError(f"{path}: no checksum for {slot.name!r} in the metadata")
        algo_of(digest)
        out[slot.name] = StoredTensor(
            e.name, e.dtype, e.shape, path, e.file_offset, e.nbytes, digest
        )
    if found:
        raise CheckpointError(
            f"{path}: holds {sorted(found)[:3]}, which the layout does not name; "
            "the file was modified"
        )
    return out


def _open_set(index_path: Path) -> FlatCheckpoint:
    index = _read_index(index_path)
    layout_dict = index.get("layout")
    text = json.dumps(layout_dict, separators=(",", ":"))
    layout = parse_layout(text, str(index_path), str(index.get("layout_checksum")))
    ranks = index.get("ranks")
    n = layout.world_size
    if not isinstance(ranks, list) or len(ranks) != n or index.get("world_size") != n:
        raise CheckpointError(
            f"{index_path}: lists {len(ranks) if isinstance(ranks, list) else 'no'} ranks "
            f"for world size {n}; the index is damaged"
        )
    optim_text = index.get("optimizer")
    optim = _optim(optim_text, index.get("version"), str(index_path), layout)
    files = tuple(
        _open_rank(index_path, layout, text, r, ranks[r], optim_text, optim) for r in range(n)
    )
    paths = tuple(index_path.parent / rank_file_name(r, n) for r in range(n))
    _check_replicas(index_path, {b.name for b in all_buffers(layout, optim)}, files)
    meta = index.get("source_metadata") or {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{index_path}: 'source_metadata' is not an object")
    source_meta = {str(k): str(v) for k, v in meta.items()}
    source = str(index.get("source", ""))
    return FlatCheckpoint(
        index_path.parent, layout, files, paths, index_path, source_meta, source, optim
    )


def _check_replicas(index_path: Path, buffers: set[str], files) -> None:
    """Every rank file holds the same copy of each kept tensor."""
    for name, t in files[0].items():
        if name in buffers:
            continue
        for r, other in enumerate(files[1:], start=1):
            if other[name].checksum != t.checksum:
                raise CheckpointError(
                    f"{index_path.parent}: kept tensor {name!r} differs between rank 0 "
                    f"({t.checksum}) and rank {r} ({other[name].checksum}); every rank "
                    "file must hold the same copy"
                )


def _read_index(path: Path) -> dict:
    index = read_json(path, error=CheckpointError)
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise not_flat(path, f"a JSON file without 'format': {INDEX_FORMAT!r}")
    _check_version(index.get("version"), path)
    return index


def _open_rank(index_path: Path, layout: Layout, text: str, r: int, item, optim_text, optim):
    folder = index_path.parent
    name = item.get("file") if isinstance(item, dict) else None
    if not isinstance(name, str) or item.get("rank") != r or Path(name).name != name:
        raise CheckpointError(f"{index_path}: entry {r} of 'ranks' is damaged: {item!r}")
    path = folder / name
    # the set is its folder: a rank file linked in from elsewhere is not read
    require_inside(folder, path, error=CheckpointError)
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: rank {r}'s file {name} is missing; the set is incomplete "
            "(copy every rank file, or convert again)"
        )
    header = read_header(path)
    md = header.metadata
    where = f"rank {r}'s file {path}"
    if md.get(KEY_FORMAT) != KIND_SHARD or md.get(KEY_RANK) != str(r):
        raise CheckpointError(
            f"{where} is not rank {r} of this set (it says {KEY_FORMAT}={md.get(KEY_FORMAT)!r}, "
            f"rank {md.get(KEY_RANK)!r}); the set mixes files"
        )
    _check_version(md.get(KEY_VERSION), where)
    if int_field(md, KEY_SHARDS, where) != layout.world_size or md.get(KEY_LAYOUT) != text:
        raise CheckpointError(
            f"{where} has a different layout than the index (mismatched rank layouts); "
            "every rank file must come from the same conversion"
        )
    if md.get(KEY_OPTIM) != optim_text:
        raise CheckpointError(
            f"{where} has different optimizer metadata than the index; every rank file "
            "must come from the same conversion"
        )
    if md.get(KEY_LAYOUT_SUM) != checksum_of(text.encode(), algo_of(md.get(KEY_LAYOUT_SUM, ""))):
        raise CheckpointError(f"{where}: the layout checksum does not match the layout")
    sums = json_field(md, KEY_CHECKSUMS, where, dict)
    if sums != item.get("checksums"):
        raise CheckpointError(
            f"{where} does not match the index's checksums for rank {r}; the file comes "
            "from another conversion or was modified"
        )
    if name != rank_file_name(r, layout.world_size):
        raise CheckpointError(f"{where}: expected the name {rank_file_name(r, layout.world_size)}")
    return _match(header, layout, layout.world_size, sums, optim)


__all__ = [
    "FlatCheckpoint",
    "StateDictItem",
    "StoredTensor",
    "layout_text",
    "open_flat",
    "read_chunks",
]
