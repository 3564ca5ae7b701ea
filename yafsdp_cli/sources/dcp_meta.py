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
Nothing here reads tensor data.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import dtypes
from ..errors import SourceError, YafsdpError
from .dcp_pickle import MetadataUnpickler, StorageMeta, is_a

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a 70B model saved by 1024 ranks needs well under this


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
    tensors, non_tensors, sizes = _check(folder, raw)
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
            raise SourceError(f"{where}: a key {fqn!r} that is not a string")
        if is_a(item, "BytesStorageMetadata"):
            non_tensors.append(fqn)
            continue
        tensors[fqn] = _check_tensor(folder, where, fqn, item, storage, sizes)
    return tensors, non_tensors, sizes


def _unpickle(path: Path, *, real_torch: bool = False):
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise SourceError(
                f"{path}: {size} bytes is too large for a checkpoint's metadata "
                f"(limit {MAX_METADATA_BYTES}); the file is not DCP metadata"
            )
        with open(path, "rb") as f:
            return MetadataUnpickler(f, path, real_torch=real_torch).load()
    except YafsdpError:
        raise
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc.strerror})") from None
    except Exception as exc:  # truncated or garbled pickle: any error its opcodes raise
        raise SourceError(
            f"{path}: not a readable torch.distributed.checkpoint metadata file "
            f"({type(exc).__name__}: {_first_line(exc)})"
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
        if not isinstance(fqn, str):
            raise SourceError(f"{where}: a storage record keyed by {key!r}")
        out[(fqn, None if offset is None else tuple(offset))] = info
    return out


def _planner_paths(raw) -> dict[str, tuple]:
    """The key path of every flattened fqn (``("model", "layers.0.w")``), where the
    saving planner recorded them; a missing or odd record gives no paths."""
    data = getattr(raw, "planner_data", None)
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, tuple) and v}


def _check_tensor(folder, where, fqn, item, storage, sizes) -> DcpTensor:
    if not is_a(item, "TensorStorageMetadata"):
        raise SourceError(f"{where}: entry {fqn!r} is a {type(item).__name__}, not a tensor")
    try:
        dtype = dtypes.from_torch(item.properties.dtype)
    except (AttributeError, YafsdpError):
        raise SourceError(
            f"{where}: tensor {fqn!r} has an unsupported dtype "
            f"{getattr(item.properties, 'dtype', None)!r}"
        ) from None
    shape = _ints(item.size)
    if shape is None:
        raise SourceError(f"{where}: tensor {fqn!r} has a bad shape {item.size!r}")
    chunks = [_chunk(where, fqn, c, shape) for c in item.chunks or ()]
    covered = sum(math.prod(size) for _, size in chunks)
    if covered != math.prod(shape):
        raise SourceError(
            f"{where}: the chunks of tensor {fqn!r} cover {covered} of its "
            f"{math.prod(shape)} elements; the checkpoint is incomplete or damaged"
        )
    _check_disjoint(where, fqn, chunks)
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


def _chunk(where, fqn, chunk, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, size = _ints(getattr(chunk, "offsets", None)), _ints(getattr(chunk, "sizes", None))
    ok = offsets is not None and size is not None and len(offsets) == len(size) == len(shape)
    if not ok or any(o + s > d for o, s, d in zip(offsets, size, shape, strict=True)):
        raise SourceError(
            f"{where}: tensor {fqn!r} of shape {list(shape)} has a chunk outside it "
            f"(offsets {getattr(chunk, 'offsets', None)}, sizes {getattr(chunk, 'sizes', None)})"
        )
    return offsets, size


def _check_disjoint(where, fqn, chunks) -> None:
    """No two chunks share an element: a sweep along dim 0 (FSDP shards dim 0, so the
    active set stays small; TP adds its degree)."""
    if not chunks or not chunks[0][0]:
        return  # a 0-d tensor: the coverage count already allows one chunk only
    spans = sorted((c for c in chunks if math.prod(c[1])), key=lambda c: c[0][0])
    active: list = []
    for off, size in spans:
        active = [a for a in active if a[0][0] + a[1][0] > off[0]]
        for a_off, a_size in active:
            if all(
                a < b + n and b < a + m for a, m, b, n in zip(a_off, a_size, off, size, strict=True)
            ):
                raise SourceError(
                    f"{where}: tensor {fqn!r} has overlapping chunks at offsets "
                    f"{list(a_off)} and {list(off)}; the checkpoint is damaged"
                )
        active.append((off, size))


def _check_storage(folder: Path, where, fqn, info, sizes: dict[str, int]) -> None:
    """The chunk's storage record names a file in the folder and a range inside it."""
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if info is None or not isinstance(name, str):
        raise SourceError(f"{where}: tensor {fqn!r} has a chunk with no storage record")
    if Path(name).name != name or name in ("", ".", "..") or "\\" in name:
        raise SourceError(
            f"{where}: tensor {fqn!r} is stored in {name!r}, outside the checkpoint folder"
        )
    if name not in sizes:
        try:
            sizes[name] = (folder / name).stat().st_size
        except OSError:
            raise SourceError(
                f"{folder}: tensor {fqn!r} is stored in {name}, which is missing; the "
                "checkpoint is incomplete (copy every .distcp file)"
            ) from None
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise SourceError(f"{where}: tensor {fqn!r} has a bad byte range {offset!r}+{length!r}")
    if offset + length > sizes[name]:
        raise SourceError(
            f"{folder / name}: tensor {fqn!r} needs bytes up to {offset + length}, but the "
            f"file has {sizes[name]} (truncated)"
        )
