"""A DCP folder's ``.metadata``, unpickled safely and checked before it is trusted.

``torch.distributed.checkpoint`` writes ``.metadata`` as a pickle of its ``Metadata``
dataclass: every tensor's global shape, dtype and chunks, and for every chunk the file
and byte range that hold it. torch's own ``FileSystemReader.read_metadata`` reads it
with ``pickle.load``, which runs whatever the file says, so we unpickle it with an
allow-list of the classes such a file holds (the metadata dataclasses, ``torch.Size``,
dtypes, layouts, paths) and refuse any other. The classes are resolved to stand-ins
(``dcp_pickle.py``), not to torch's: importing torch costs more than copying the
checkpoint, and nothing here needs it. Then the content is checked as hostile:
each tensor has a known dtype and a non-negative shape, its chunks lie inside it and
tile it exactly (no hole would be left as stale memory, no overlap), and every chunk
has a storage record naming a file in the folder and a byte range inside that file.
Nothing here reads tensor data, and no check costs more than the file's size
warrants: shapes pass the one size rule of every reader (``dtypes.shape_problem``)
before anything is computed from them, the tiling check is linear for the chunk
grids DTensor saves, and messages quote a bounded excerpt of a bad value (a list
that holds one list many times is a few bytes of pickle and billions of elements
when written out). ``.metadata`` and the data files are read only when they lie in
the folder: a symbolic link out of it (to ``/proc/self/environ``, a home folder) is
refused by name.
"""

from __future__ import annotations

import functools
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import dtypes
from ..errors import SourceError, YafsdpError, cut, excerpt, printable
from ..fileio import read_capped, require_file, require_inside
from .dcp_pickle import MetadataUnpickler, MissingFieldError, StorageMeta, is_a
from .pickle_guard import PickleShapeError, check_pickle

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a 70B model saved by 1024 ranks needs well under this
NAME_CHARS = 200  # of a name from the file, quoted in a message
# The tiling check visits each chunk a few times per dimension it is split along
# (DTensor's grids of shards cancel out at every inner boundary); a chunking whose
# pieces never line up costs more, up to this many visits per chunk, then is refused.
TILING_VISITS_PER_CHUNK = 64


@dataclass(frozen=True, slots=True)
class DcpTensor:
    """One tensor of a DCP checkpoint, as its metadata describes it (whole, unsharded)."""

    fqn: str  # the flattened key it is stored under, e.g. "model.layers.0.mlp.w1.weight"
    shape: tuple[int, ...]
    dtype: str
    chunks: int  # pieces it was saved in (one per rank that held a shard of it)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)


@dataclass(frozen=True)
class DcpMetadata:
    folder: Path
    tensors: dict[str, DcpTensor]  # by fqn, in the metadata's order
    non_tensors: tuple[str, ...]  # fqns of pickled values (param groups, counters)
    paths: dict[str, tuple]  # fqn -> its key path in the saved (nested) state dict
    files: tuple[Path, ...]  # the data files the chunks live in
    raw: Any  # the checked metadata, as stand-ins (``dcp_pickle``)

    def storage(self, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
        """``(offsets, sizes, storage record)`` of each chunk of tensor ``fqn`` (its
        storage record ``None`` for an empty chunk), or ``[((), (), record)]`` for a
        pickled value."""
        item = self.raw.state_dict_metadata[fqn]
        index = self._index
        if fqn in self.non_tensors:
            return [((), (), index.get((fqn, None)))]
        out = []
        for c in item.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            out.append((offsets, sizes, index.get((fqn, offsets)) if math.prod(sizes) else None))
        return out

    def check_record(self, fqn: str, info) -> None:
        """A pickled value's storage record names a file in the folder and a byte range
        inside it (a tensor's records were checked when the metadata was read)."""
        _check_storage(self.folder, self.folder / METADATA_NAME, fqn, info, {})

    @functools.cached_property
    def _index(self) -> dict[tuple, Any]:
        return _storage_index(self.folder / METADATA_NAME, self.raw.storage_data)

    @functools.cached_property
    def torch_raw(self):
        """The same metadata as torch's own classes, for torch's reader: read again with
        the same allow-list and checked again (``dcp_data`` uses it for the chunks only
        torch reads). Imports torch."""
        raw = _unpickle(self.folder / METADATA_NAME, real_torch=True)
        _check(self.folder, raw)
        if getattr(raw, "storage_meta", None) is None:  # as torch's own reader does
            from torch.distributed.checkpoint.metadata import StorageMeta as TorchStorageMeta

            raw.storage_meta = TorchStorageMeta()
        return raw


def read_dcp_metadata(folder: Path) -> DcpMetadata:
    """``folder``'s ``.metadata``, safely unpickled and checked (see the module note)."""
    raw = _unpickle(folder / METADATA_NAME)
    try:
        tensors, non_tensors, sizes = _check(folder, raw)
    except MissingFieldError as exc:
        raise SourceError(f"{folder / METADATA_NAME}: {exc}; the metadata is damaged") from None
    if getattr(raw, "storage_meta", None) is None:  # as torch's own reader does
        raw.storage_meta = StorageMeta()
    return DcpMetadata(
        folder=folder,
        tensors=tensors,
        non_tensors=tuple(non_tensors),
        paths=_planner_paths(raw),
        files=tuple(folder / name for name in sorted(sizes)),
        raw=raw,
    )


def _check(folder: Path, raw) -> tuple[dict[str, DcpTensor], list[str], dict[str, int]]:
    where = folder / METADATA_NAME
    if not is_a(raw, "Metadata") or not isinstance(raw.state_dict_metadata, dict):
        raise SourceError(f"{where}: not a torch.distributed.checkpoint Metadata object")
    storage = _storage_index(where, raw.storage_data)
    sizes: dict[str, int] = {}
    tensors: dict[str, DcpTensor] = {}
    non_tensors = []
    for fqn, item in raw.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise SourceError(f"{where}: a key {excerpt(fqn)} that is not a string")
        if is_a(item, "BytesStorageMetadata"):
            non_tensors.append(fqn)
            continue
        tensors[fqn] = _check_tensor(folder, where, fqn, item, storage, sizes)
    return tensors, non_tensors, sizes


def _unpickle(path: Path, *, real_torch: bool = False):
    require_inside(path.parent, path)
    raw = read_capped(path, MAX_METADATA_BYTES, what="a checkpoint's metadata")
    try:
        check_pickle(raw)
    except PickleShapeError as exc:
        raise SourceError(
            f"{path}: not a readable torch.distributed.checkpoint metadata file ({cut(str(exc))})"
        ) from None
    try:
        return MetadataUnpickler(io.BytesIO(raw), path, real_torch=real_torch).load()
    except YafsdpError:
        raise
    except Exception as exc:  # truncated or garbled pickle: any error its opcodes raise
        raise SourceError(
            f"{path}: not a readable torch.distributed.checkpoint metadata file "
            f"({type(exc).__name__}: {cut(_first_line(exc))})"
        ) from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _storage_index(where: Path, storage_data) -> dict[tuple, Any]:
    """``{(fqn, chunk offsets): storage record}`` from the metadata's storage map."""
    if not isinstance(storage_data, dict):
        raise SourceError(f"{where}: no storage map (storage_data); the metadata is damaged")
    out = {}
    for key, info in storage_data.items():
        fqn, offset = getattr(key, "fqn", None), getattr(key, "offset", None)
        offsets = None if offset is None else _ints(offset)
        if not isinstance(fqn, str) or (offset is not None and offsets is None):
            raise SourceError(f"{where}: a storage record keyed by {excerpt(key)}")
        out[(fqn, offsets)] = info
    return out


def _planner_paths(raw) -> dict[str, tuple]:
    """The key path of every flattened fqn (``("model", "layers.0.w")``), where the
    saving planner recorded them; a missing or odd record gives no paths."""
    data = getattr(raw, "planner_data", None)
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and _key_path(v)}


def _key_path(value) -> bool:
    """A key path as ``dcp.save`` records it: a tuple of names and list indices (so
    nothing nested in it is walked, printed or hashed later)."""
    return type(value) is tuple and bool(value) and all(type(k) in (str, int) for k in value)


def _check_tensor(folder, where, fqn, item, storage, sizes) -> DcpTensor:
    if not is_a(item, "TensorStorageMetadata"):
        raise SourceError(f"{where}: entry {_q(fqn)} is a {type(item).__name__}, not a tensor")
    try:
        dtype = dtypes.from_torch(item.properties.dtype)
    except (AttributeError, YafsdpError):
        raise SourceError(
            f"{where}: tensor {_q(fqn)} has an unsupported dtype "
            f"{excerpt(getattr(item.properties, 'dtype', None))}"
        ) from None
    size = getattr(item, "size", None)
    shape = tuple(size) if isinstance(size, (list, tuple)) else None
    why = dtypes.shape_problem(shape, dtype) if shape is not None else "not a list"
    if why is not None:
        raise SourceError(
            f"{where}: tensor {_q(fqn)} has a bad shape {excerpt(_listed(size))}: {why}"
        )
    listed = getattr(item, "chunks", None)
    if not isinstance(listed, (list, tuple)):
        raise SourceError(f"{where}: tensor {_q(fqn)} has no list of chunks")
    chunks = [_chunk(where, fqn, c, shape) for c in listed]
    covered = sum(math.prod(size) for _, size in chunks)
    if covered != math.prod(shape):
        raise SourceError(
            f"{where}: the chunks of tensor {_q(fqn)} cover {covered} of its "
            f"{math.prod(shape)} elements; the checkpoint is incomplete or damaged"
        )
    _check_disjoint(where, fqn, shape, chunks)
    for offsets, size in chunks:
        if math.prod(size):  # an empty shard (a rank with no rows) is never read
            _check_storage(folder, where, fqn, storage.get((fqn, offsets)), sizes)
    return DcpTensor(fqn, shape, dtype, len(chunks))


def _ints(values) -> tuple[int, ...] | None:
    try:
        out = tuple(values)
    except TypeError:
        return None
    return out if all(type(v) is int and v >= 0 for v in out) else None


def _listed(value):
    """A shape as a message shows it: ``[2, 3]``, not ``(2, 3)``."""
    return list(value) if isinstance(value, tuple) else value


def _q(name: str) -> str:
    """A name from the file, quoted for a message (bounded, control characters escaped)."""
    return excerpt(name, NAME_CHARS)


def _chunk(where, fqn, chunk, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, size = _ints(getattr(chunk, "offsets", None)), _ints(getattr(chunk, "sizes", None))
    ok = offsets is not None and size is not None and len(offsets) == len(size) == len(shape)
    if not ok or any(o + s > d for o, s, d in zip(offsets, size, shape, strict=True)):
        raise SourceError(
            f"{where}: tensor {_q(fqn)} of shape {list(shape)} has a chunk outside it "
            f"(offsets {excerpt(getattr(chunk, 'offsets', None))}, "
            f"sizes {excerpt(getattr(chunk, 'sizes', None))})"
        )
    return offsets, size


def _check_disjoint(where, fqn, shape, chunks) -> None:
    """No two chunks share an element. The chunks lie inside the tensor and their
    sizes add up to its size (checked before), so they share none exactly when they
    tile it, which ``_tiles`` checks in time linear in the chunks for the grids of
    shards DTensor saves; only then is a pair that overlaps looked for, to name it."""
    boxes = [c for c in chunks if math.prod(c[1])]
    if not boxes or not shape:
        return  # nothing stored, or a 0-d tensor: the coverage count allows one chunk only
    budget = [TILING_VISITS_PER_CHUNK * len(boxes) + 4096]
    try:
        if _tiles(boxes, shape, budget):
            return
    except _TooIrregularError:
        raise SourceError(
            f"{where}: tensor {_q(fqn)} is saved in {len(boxes)} chunks that do not line up "
            "along any dimension, too irregular to check; torch.distributed.checkpoint "
            "saves grids of shards, so the metadata is not its own"
        ) from None
    pair = _overlapping_pair(boxes)
    at = f" at offsets {list(pair[0])} and {list(pair[1])}" if pair else ""
    raise SourceError(
        f"{where}: tensor {_q(fqn)} has overlapping chunks{at}; the checkpoint is damaged"
    )


class _TooIrregularError(Exception):
    """The tiling check ran out of its budget."""


def _tiles(boxes, shape, budget: list[int]) -> bool:
    """Whether the boxes ``(offsets, sizes)`` tile ``[0, shape)`` exactly: every
    element in exactly one of them.

    As functions of the index, a box's indicator is a product over dimensions of
    ``H(x - start) - H(x - end)`` (``H`` a step), and steps at different positions are
    linearly independent. So "the boxes' indicators add up to the tensor's" holds
    exactly when, for each position ``c`` along one dimension, the boxes that start
    at ``c`` and those that end there (with the opposite sign) add up to the same
    thing over the other dimensions: one smaller problem per position, each box in
    two of them. Boxes equal over the remaining dimensions cancel before going
    further, and a dimension every box spans alike is dropped, so a grid costs a
    few visits per chunk and dimension; ``budget`` bounds the rest."""
    items = [(1, off, tuple(o + n for o, n in zip(off, size, strict=True))) for off, size in boxes]
    items.append((-1, (0,) * len(shape), tuple(shape)))
    return _sums_to_zero(items, budget)


def _sums_to_zero(items, budget: list[int]) -> bool:
    """Whether the weighted boxes ``(weight, starts, ends)`` add up to zero everywhere."""
    merged: dict[tuple, int] = {}
    for w, lo, hi in items:
        merged[(lo, hi)] = merged.get((lo, hi), 0) + w
    live = [(w, lo, hi) for (lo, hi), w in merged.items() if w]
    budget[0] -= len(items)
    if budget[0] < 0:
        raise _TooIrregularError
    if not live:
        return True
    dims = len(live[0][1])
    first = live[0]
    keep = [d for d in range(dims) if any(lo[d] != first[1][d] or hi[d] != first[2][d]
                                          for _, lo, hi in live)]  # fmt: skip
    if not keep:  # every box alike: their weights must cancel
        return sum(w for w, _, _ in live) == 0
    d = keep[0]
    rest = keep[1:]
    groups: dict[int, list] = {}
    for w, lo, hi in live:
        sub_lo, sub_hi = tuple(lo[i] for i in rest), tuple(hi[i] for i in rest)
        groups.setdefault(lo[d], []).append((w, sub_lo, sub_hi))
        groups.setdefault(hi[d], []).append((-w, sub_lo, sub_hi))
    return all(_sums_to_zero(group, budget) for group in groups.values())


def _overlapping_pair(boxes, comparisons: int = 200_000):
    """The offsets of two boxes that share an element, or None when none is found
    within ``comparisons`` comparisons: a sweep along the dimension with the most
    distinct offsets (the one the shards split most finely, so few boxes are in play
    at once)."""
    d = max(range(len(boxes[0][0])), key=lambda i: len({off[i] for off, _ in boxes}))
    active: list = []
    for off, size in sorted(boxes, key=lambda c: c[0][d]):
        active = [a for a in active if a[0][d] + a[1][d] > off[d]]
        comparisons -= len(active)
        if comparisons < 0:
            return None
        for a_off, a_size in active:
            if all(
                a < b + n and b < a + m for a, m, b, n in zip(a_off, a_size, off, size, strict=True)
            ):
                return a_off, off
        active.append((off, size))
    return None


def _check_storage(folder: Path, where, fqn, info, sizes: dict[str, int]) -> None:
    """The chunk's storage record names a file in the folder and a range inside it."""
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if info is None or not isinstance(name, str):
        raise SourceError(f"{where}: tensor {_q(fqn)} has a chunk with no storage record")
    if Path(name).name != name or name in ("", ".", "..") or "\\" in name or "\0" in name:
        raise SourceError(
            f"{where}: tensor {_q(fqn)} is stored in {_q(name)}, outside the checkpoint folder"
        )
    if name not in sizes:
        path = folder / name
        if not os.path.lexists(path):
            raise SourceError(
                f"{folder}: tensor {_q(fqn)} is stored in {printable(name)}, which is missing; "
                "the checkpoint is incomplete (copy every .distcp file)"
            )
        require_inside(folder, path, where=str(folder))
        sizes[name] = require_file(path)
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise SourceError(
            f"{where}: tensor {_q(fqn)} has a bad byte range {excerpt(offset)}+{excerpt(length)}"
        )
    if offset + length > sizes[name]:
        raise SourceError(
            f"{folder / printable(name)}: tensor {_q(fqn)} needs bytes up to {offset + length}, "
            f"but the file has {sizes[name]} (truncated)"
        )
