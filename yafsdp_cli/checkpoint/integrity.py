"""Checking a flat checkpoint's bytes: each stored tensor's checksum and zero padding.

``digest_of`` gives a stored tensor's checksum as its bytes give it. The ranges that
a ``Copier`` with a ledger has already copied (restore, reshard) are not read again:
their CRC-32s are combined (``crc.crc32_combine``) with those of the bytes it did
not copy, which are read here (padding, whose zeros are checked, and the replicas
of kept tensors in other rank files). Holes of a sparse file are zeros, not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engine import dtypes
from ..engine.layout import BufferLayout
from ..errors import CheckpointError
from .crc import crc32_combine
from .file_ranges import Copier, FileRange
from .format import Checksum, algo_of
from .results import Progress


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor in a flat file: bytes ``[offset, offset + nbytes)`` of ``path``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # from the start of the file
    nbytes: int
    checksum: str  # as the metadata records it


def digest_of(t: StoredTensor, pads, copier: Copier, tick) -> str:
    """``t``'s checksum text: the ledger's pieces combined with the rest, read."""
    algo = algo_of(t.checksum)
    pieces = copier.ledger.within(t.path, t.offset, t.nbytes) if copier.ledger else []
    if algo != "crc32" or not _trustworthy(pieces, t.offset, pads):
        digest = Checksum(algo)
        copier.hash(FileRange(t.path, t.offset, t.nbytes), digest, _zero_check(t, pads, 0), tick)
        return digest.text()
    crc, pos = 0, 0  # pos: bytes of t covered so far
    for offset, n, piece_crc in [*pieces, (t.offset + t.nbytes, 0, 0)]:
        start = offset - t.offset
        if start > pos:  # not copied: padding or a replica; read it here
            gap = FileRange(t.path, t.offset + pos, start - pos)
            gap_crc = copier.crc_of(gap, _zero_check(t, pads, pos), tick)
            crc = crc32_combine(crc, gap_crc, start - pos)
        crc = crc32_combine(crc, piece_crc, n)
        tick(n)
        pos = start + n
    return f"crc32:{crc:08x}"


def _trustworthy(pieces, base: int, pads) -> bool:
    """Copied pieces can stand for the bytes if they do not overlap each other or
    the padding (whose zeros must be seen)."""
    pos = 0
    for offset, n, _ in pieces:
        start = offset - base
        if start < pos or any(a < start + n and start < z for a, z in pads):
            return False
        pos = start + n
    return True


def _zero_check(t: StoredTensor, pads, shift: int):
    if not pads:
        return None
    return lambda pos, chunk: _check_zero(t, pads, shift + pos, chunk)


def padding(b: BufferLayout, rank: int, shards: int) -> list[tuple[int, int]]:
    """Byte ranges, relative to rank ``rank``'s slice of ``b``, that are padding."""
    size = b.padded_numel // shards
    lo, hi = rank * size, (rank + 1) * size
    out, pos = [], lo
    for e in b.entries:
        if e.offset + e.numel <= lo or not e.numel:
            continue
        if e.offset >= hi:
            break
        if e.offset > pos:
            out.append((pos, e.offset))
        pos = max(pos, e.offset + e.numel)
    if pos < hi:
        out.append((pos, hi))
    isz = dtypes.itemsize(b.dtype)
    return [((a - lo) * isz, (z - lo) * isz) for a, z in out]


class Ticks:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress("checking", self.done, self.total)


def _check_zero(t: StoredTensor, pads, pos: int, chunk: memoryview) -> None:
    end = pos + len(chunk)
    for a, z in pads:
        if z <= pos or a >= end:
            continue
        piece = chunk[max(a, pos) - pos : min(z, end) - pos].tobytes()
        if piece != bytes(len(piece)):
            first = max(a, pos) + next(i for i, v in enumerate(piece) if v)
            raise CheckpointError(
                f"{t.path}: padding of buffer {t.name!r} is not zero (byte {first} of the "
                "stored tensor); padding must be zero: the file was modified"
            )
