"""Where a DCP checkpoint's bytes lie, found without torch.

DCP's default ``FileSystemWriter`` writes every chunk (one tensor, or the part of it
one rank held) and every pickled value as a ``torch.save`` archive at the offset
and length its metadata records (``_write_item`` in torch's ``filesystem.py``). A
tensor's bytes are then one stored member of that archive, so they can be copied
file to file by byte range, as a safetensors source's are, and importing torch
(over a second) is not needed at all. ``tensor_pieces`` finds them:

- the archive is parsed from its end (``torch_archive.read_archive``), its
  ``data.pkl`` read with an unpickler that knows torch.save's tensor calls only
  (``torch_pickle``), and the tensor it describes must have the metadata's dtype
  and the chunk's shape, and a storage member of exactly the storage's size;
  anything else is damage, refused with one line;
- a tensor is read directly when each chunk is one contiguous run of its storage
  (any storage offset) and the chunks split it along dim 0 only (FSDP's shards), so
  that the chunks in offset order are the tensor's bytes in row-major order;
- anything valid but not read directly here (stream transforms of DCP's extensions,
  a compressed or big-endian archive, a non-contiguous view, a pickle global
  outside torch.save's plain-tensor vocabulary, chunks split along another dim)
  gives ``None``, and the caller reads that tensor with torch's own reader as
  before, which then reads it or refuses it as it always did.

Bytes read directly are checked against the CRC-32 the archive stores for their
member (torch's reader does not check it): ``ChunkBytes.member`` is what a copier
compares its read-back CRC with.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import dtypes
from ..errors import SourceError, excerpt, printable
from ..fileio import read_exact
from .dcp_meta import DcpMetadata
from .torch_archive import Archive, Member, NeedsTorchError, check_crc, read_archive
from .torch_pickle import Dtype, RawTensor, TensorRef, load_pickle

MAX_PICKLE = 16 * 1024 * 1024  # data.pkl of one tensor is ~200 bytes; a value's is small
MAX_VALUE_TENSOR = 16 * 1024 * 1024  # a tensor inside a pickled value, read into memory
# A pickled value is walked item by item: at most this many per byte of its pickle
# (each item of a plain value costs at least one opcode; one list referenced many
# times costs a few bytes per reference and expands when walked), and this deep.
VALUE_ITEMS_PER_BYTE = 4
MAX_VALUE_DEPTH = 100


@dataclass(frozen=True, slots=True)
class ChunkBytes:
    """One chunk's tensor bytes, ``[offset, offset + nbytes)`` of ``path``, inside the
    archive member ``member`` (whose stored CRC-32 covers the whole member)."""

    path: Path
    offset: int
    nbytes: int
    member: Member


def tensor_pieces(md: DcpMetadata, fqn: str) -> list[ChunkBytes] | None:
    """Tensor ``fqn``'s bytes in row-major order as file pieces, or None where torch's
    reader must read it (see the module note); ``SourceError`` for damage."""
    meta = md.tensors[fqn]
    chunks = [(o, s, info) for o, s, info in md.storage(fqn) if math.prod(s)]
    if len(chunks) > 1 and any(s[1:] != meta.shape[1:] for _, s, _ in chunks):
        return None  # split along another dim: the chunks' bytes interleave
    pieces = []
    for _, sizes, info in sorted(chunks, key=lambda c: c[0][:1]):
        piece = _chunk(md, fqn, info, sizes, meta.dtype)
        if piece is None:
            return None
        pieces.append(piece)
    return pieces


def _where(md: DcpMetadata, info) -> str:
    return f"the chunk at byte {info.offset} of {printable(info.relative_path)}"


def _failed(md: DcpMetadata, fqn: str, why: SourceError) -> SourceError:
    return SourceError(f"{md.folder}: reading {excerpt(fqn, 200)} failed ({why})")


def _open(md: DcpMetadata, fqn: str, info) -> Archive | None:
    """The archive a storage record points to, or None for a layout torch reads."""
    if getattr(info, "transform_descriptors", None):
        return None  # DCP's stream extensions (compression, ...): torch's registry reads them
    try:
        archive = read_archive(md.folder / info.relative_path, info.offset, info.length,
                               _where(md, info))  # fmt: skip
        byteorder = archive.members.get("byteorder")
        if byteorder is not None and archive.read("byteorder", 16, _where(md, info)) != b"little":
            return None  # torch swaps the bytes of a big-endian archive
        return archive
    except NeedsTorchError:
        return None
    except SourceError as exc:
        raise _failed(md, fqn, exc) from None


def _pickled(md: DcpMetadata, fqn: str, info, archive: Archive) -> Any:
    """data.pkl's object; ``NeedsTorchError`` for what only torch reads."""
    where = _where(md, info)
    try:
        data = archive.read("data.pkl", MAX_PICKLE, where)
    except SourceError as exc:
        raise _failed(md, fqn, exc) from None
    try:
        return load_pickle(data)
    except NeedsTorchError:
        raise
    except Exception as exc:  # a garbled pickle: whatever its opcodes raise
        lines = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        raise _failed(md, fqn, SourceError(f"{where}: data.pkl is damaged ({why})")) from None


def _chunk(md: DcpMetadata, fqn: str, info, sizes, dtype: str) -> ChunkBytes | None:
    archive = _open(md, fqn, info)
    if archive is None:
        return None
    try:
        ref = _pickled(md, fqn, info, archive)
    except NeedsTorchError:
        return None
    where = _where(md, info)
    if not isinstance(ref, TensorRef):
        raise _failed(md, fqn, SourceError(f"{where} holds a {type(ref).__name__}, not a tensor"))
    if (ref.dtype, ref.shape) != (dtype, tuple(sizes)):
        raise _failed(md, fqn, SourceError(
            f"{where} holds a {ref.dtype}{list(ref.shape)} tensor, but the metadata says "
            f"{dtype}{list(sizes)}"
        ))  # fmt: skip
    member = _storage_member(md, fqn, where, archive, ref)
    try:
        start, nbytes = ref.byte_range(member.nbytes)
    except NeedsTorchError:
        return None
    return ChunkBytes(archive.path, member.offset + start, nbytes, member)


def _storage_member(md: DcpMetadata, fqn: str, where: str, archive: Archive, ref: TensorRef):
    member = archive.members.get(f"data/{ref.storage.key}")
    isz = dtypes.itemsize(ref.storage.dtype) if ref.storage.dtype else 1
    if member is None or member.nbytes != ref.storage.numel * isz:
        have = "no member" if member is None else f"{member.nbytes} bytes"
        raise _failed(md, fqn, SourceError(
            f"{where}: storage {ref.storage.key} of {ref.storage.numel * isz} bytes has {have} "
            "in the archive"
        ))  # fmt: skip
    return member


def read_pieces(pieces: list[ChunkBytes], where: str) -> bytes:
    """The bytes of small pieces, each member checked against its CRC-32 (a tensor
    that fills its member is checked by itself; a view, with the rest read too)."""
    out = []
    for p in pieces:
        m = p.member
        whole = read_exact(p.path, m.offset, m.nbytes, error=SourceError)
        check_crc(m, zlib.crc32(whole), where)
        out.append(whole[p.offset - m.offset : p.offset - m.offset + p.nbytes])
    return b"".join(out)


def read_values(md: DcpMetadata, fqns: list[str]) -> dict[str, Any] | None:
    """The values of small tensors (as ``RawTensor``) and pickled items, or None when
    one of them needs torch's reader (the caller then reads them all with torch)."""
    out = {}
    for fqn in fqns:
        if fqn in md.tensors:
            pieces = tensor_pieces(md, fqn)
            if pieces is None:
                return None
            meta = md.tensors[fqn]
            data = read_pieces(pieces, f"{md.folder}: {excerpt(fqn, 200)}")
            out[fqn] = RawTensor(meta.dtype, meta.shape, data)
            continue
        value = _value(md, fqn)
        if value is _TORCH:
            return None
        out[fqn] = value
    return out


_TORCH = object()  # "torch's reader must read this value"


def _value(md: DcpMetadata, fqn: str) -> Any:
    """A pickled item's value, tensors in it as ``RawTensor``."""
    info = md.storage(fqn)[0][2]
    if info is None:
        return _TORCH  # no storage record: torch's reader says what is missing
    md.check_record(fqn, info)
    archive = _open(md, fqn, info)
    if archive is None:
        return _TORCH
    try:
        value = _pickled(md, fqn, info, archive)
        pickled = archive.members["data.pkl"].nbytes  # read whole just now
        walk = _Walk(archive, md, fqn, info, VALUE_ITEMS_PER_BYTE * pickled + 1024)
        return _materialize(value, walk, 0)
    except NeedsTorchError:
        return _TORCH


@dataclass
class _Walk:
    """What ``_materialize`` carries down a value: where it is, and how many more
    items it may visit."""

    archive: Archive
    md: DcpMetadata
    fqn: str
    info: Any
    items_left: int

    def refuse(self, why: str) -> SourceError:
        return _failed(self.md, self.fqn, SourceError(f"{_where(self.md, self.info)}: {why}"))


def _materialize(value: Any, walk: _Walk, depth: int) -> Any:
    """``value`` with each ``TensorRef`` read into a ``RawTensor``; a value that holds
    more items than its pickle's size warrants, or nests too deeply, is refused."""
    walk.items_left -= 1
    if walk.items_left < 0:
        raise walk.refuse(
            "the pickled value holds far more items than its size warrants (one list "
            "referenced over and over); the checkpoint is damaged"
        )
    if depth > MAX_VALUE_DEPTH:
        raise walk.refuse(f"the pickled value nests more than {MAX_VALUE_DEPTH} deep")
    archive, md, fqn, info = walk.archive, walk.md, walk.fqn, walk.info
    if isinstance(value, TensorRef):
        why = dtypes.shape_problem(value.shape, value.dtype)
        if why is not None:
            raise walk.refuse(f"a tensor of shape {excerpt(list(value.shape))}: {why}")
        where = _where(md, info)
        member = _storage_member(md, fqn, where, archive, value)
        if member.nbytes > MAX_VALUE_TENSOR:
            raise NeedsTorchError("a large tensor inside a value")
        start, nbytes = value.byte_range(member.nbytes)
        piece = ChunkBytes(archive.path, member.offset + start, nbytes, member)
        try:
            data = read_pieces([piece], where)
        except SourceError as exc:
            raise _failed(md, fqn, exc) from None
        return RawTensor(value.dtype, value.shape, data)
    if isinstance(value, Dtype):
        raise NeedsTorchError("a dtype as a value")
    if isinstance(value, list):
        return [_materialize(v, walk, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, walk, depth + 1) for v in value)
    if isinstance(value, dict):
        items = [(k, _materialize(v, walk, depth + 1)) for k, v in value.items()]
        return type(value)(items)
    return value
