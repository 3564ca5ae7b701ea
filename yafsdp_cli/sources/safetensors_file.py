"""Reading safetensors files and sharded sets from their headers, defensively.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian
header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {str: str}}``, then the data; offsets are relative to the end of
the header, and the tensors tile the data exactly.

Every file is hostile until checked: the header length, the JSON, each entry's
dtype, shape and offsets (in range, sized right, not overlapping, no holes) are
validated before any tensor is trusted. Only the header is read here; tensor bytes
are read later, in chunks, with plain file reads (no mmap, so a 138 GB file costs
no address space and its pages do not count as our memory).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..engine import dtypes
from ..errors import SourceError, YafsdpError, excerpt
from ..fileio import CHUNK_BYTES, read_chunks, read_json, require_file
from .shards import shard_names, shard_path

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


@dataclass(frozen=True, slots=True)
class StEntry:
    """One tensor in a safetensors file: ``data[begin:end]`` of the file's data part."""

    name: str
    dtype: str  # canonical dtype name
    shape: tuple[int, ...]
    begin: int
    end: int
    path: Path
    data_start: int  # file offset where the data part starts (8 + header length)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def file_offset(self) -> int:
        return self.data_start + self.begin


@dataclass(frozen=True, slots=True)
class StHeader:
    path: Path
    entries: tuple[StEntry, ...]  # in data order
    metadata: dict[str, str]
    data_start: int
    data_len: int


def read_header(path: Path) -> StHeader:
    """Parse and validate ``path``'s header; raises ``SourceError`` naming what is wrong."""
    size = require_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise SourceError(
                    f"{path}: header length {n} is impossible for a {size}-byte file "
                    "(truncated or not safetensors)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise SourceError(f"{path}: cannot read ({exc.strerror})") from None
    header = _parse_json(path, raw)
    return _validate(path, header, data_start=8 + n, data_len=size - 8 - n)


def _parse_json(path: Path, raw: bytes) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise SourceError(f"{path}: header names tensor {dup!r} twice")
        return dict(pairs)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path}: header is not valid UTF-8 ({exc})") from None
    try:
        header = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: header is not valid JSON ({exc})") from None
    except RecursionError:
        raise SourceError(f"{path}: header is nested too deeply to be safetensors") from None
    if not isinstance(header, dict):
        raise SourceError(f"{path}: header is not a JSON object")
    try:  # JSON may spell a lone surrogate ("\udc80"), which is no Unicode text
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise SourceError(
            f"{path}: header holds an invalid Unicode escape (a lone surrogate)"
        ) from None
    return header


def _validate(path: Path, header: dict, *, data_start: int, data_len: int) -> StHeader:
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SourceError(f"{path}: __metadata__ must map strings to strings")
    entries = [_entry(path, name, info, data_start) for name, info in header.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            what = "overlaps the previous tensor" if e.begin < pos else f"leaves a hole at {pos}"
            raise SourceError(f"{path}: tensor {e.name!r} at offset {e.begin} {what}")
        pos = e.end
    if pos != data_len:
        what = "truncated: the header describes" if pos > data_len else "the header covers only"
        raise SourceError(f"{path}: {what} {pos} bytes of data, the file has {data_len}")
    return StHeader(path, tuple(entries), metadata, data_start, data_len)


def _entry(path: Path, name: str, info, data_start: int) -> StEntry:
    if not isinstance(info, dict):
        raise SourceError(f"{path}: entry {name!r} is not an object")
    try:
        dtype = dtypes.from_safetensors(info["dtype"])
    except (KeyError, TypeError, YafsdpError):
        raise SourceError(
            f"{path}: tensor {name!r} has unknown dtype {info.get('dtype')!r}"
        ) from None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    why = dtypes.shape_problem(shape, dtype) if isinstance(shape, list) else "not a list"
    if why is not None:
        raise SourceError(f"{path}: tensor {name!r} has a bad shape {excerpt(shape)}: {why}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SourceError(f"{path}: tensor {name!r} has bad data_offsets {offsets!r}")
    expected = math.prod(shape) * dtypes.itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise SourceError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but "
            f"{dtype}{shape} needs {expected}"
        )
    return StEntry(name, dtype, tuple(shape), offsets[0], offsets[1], path, data_start)


def read_index(path: Path) -> list[StHeader]:
    """The headers of a sharded set named by ``*.safetensors.index.json``."""
    index = read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceError(f"{path}: no weight_map; is this a safetensors index?")
    files = shard_names(path, weight_map)
    headers = []
    for name in files:
        headers.append(read_header(shard_path(path, name)))
    _check_index(path, weight_map, headers)
    return headers


def _check_index(path: Path, weight_map: dict, headers: list[StHeader]) -> None:
    where = {e.name: h.path.name for h in headers for e in h.entries}
    for tensor, file in weight_map.items():
        if where.get(tensor) != Path(str(file)).name:
            found = where.get(tensor)
            raise SourceError(
                f"{path}: weight_map puts {tensor!r} in {file}, "
                + (f"but it is in {found}" if found else "but no shard it names has it")
            )
    extra = sorted(set(where) - set(weight_map))
    if extra:
        raise SourceError(f"{path}: shards hold tensors the weight_map does not name: {extra[:3]}")


class SafetensorsReader:
    """Byte access to the tensors of one or more validated safetensors files."""

    def __init__(self, headers: list[StHeader]):
        self.headers = headers
        self.entries: dict[str, StEntry] = {}
        for h in headers:
            for e in h.entries:
                if e.name in self.entries:
                    raise SourceError(
                        f"tensor {e.name!r} is in both {self.entries[e.name].path} and {h.path}"
                    )
                self.entries[e.name] = e

    def names(self) -> list[str]:
        return list(self.entries)

    def nbytes(self, name: str) -> int:
        return self.entries[name].nbytes

    def iter_bytes(self, name: str, chunk: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The tensor's bytes in chunks; each chunk is valid until the next one."""
        e = self.entries[name]
        what = f"inside tensor {name!r}"
        return read_chunks(e.path, e.file_offset, e.nbytes, chunk, error=SourceError, what=what)

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]]:
        """Where the tensor's bytes lie: one ``(path, file offset, nbytes)``, so that
        they can be copied file to file without passing through this process."""
        e = self.entries[name]
        return [(e.path, e.file_offset, e.nbytes)]

    def check_copied(self, crc_of) -> None:
        """Nothing to check: safetensors stores no checksums."""

    def files(self) -> list[Path]:
        return [h.path for h in self.headers]

    def load(self, name: str):
        """One tensor as a new torch tensor (copies the bytes; torch is imported here)."""
        import torch

        e = self.entries[name]
        data = bytearray(e.nbytes)
        pos = 0
        for piece in self.iter_bytes(name):
            data[pos : pos + len(piece)] = piece
            pos += len(piece)
        if not e.nbytes:
            return torch.empty(e.shape, dtype=dtypes.to_torch(e.dtype))
        flat = torch.frombuffer(data, dtype=dtypes.to_torch(e.dtype))
        return flat.reshape(e.shape)


def open_safetensors(path: Path) -> SafetensorsReader:
    if path.name.endswith(".index.json"):
        return SafetensorsReader(read_index(path))
    return SafetensorsReader([read_header(path)])
