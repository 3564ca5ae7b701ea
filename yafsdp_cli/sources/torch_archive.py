"""``torch.save`` archives, read and written without importing torch.

``torch.save`` writes a zip archive: ``PREFIX/data.pkl`` (the pickled object, each
tensor a ``_rebuild_tensor_v2``/``_v3`` call naming a storage by key), one member
``PREFIX/data/KEY`` per storage holding its raw bytes, stored uncompressed and
starting at a multiple of 64 bytes from the archive's start, and small members
(``byteorder``, ``version``, ...). Every local header says "sizes in a data
descriptor" (bit 3), so the CRC-32 and sizes follow each member's data, and the
central directory, a zip64 end record and the classic end record close the archive.
DCP's ``FileSystemWriter`` writes each chunk of a checkpoint as one such archive at a
recorded offset in a ``.distcp`` file.

``read_archive`` parses an archive from its end (the central directory), without
trusting it: sizes and offsets must stay inside the archive's byte range and the
directory is bounded. ``ArchiveWriter`` lays one out as torch's writer does (the
same members, order, padding extra field ``FB`` and data descriptors; zip64 fields
where a size or offset needs them), so that ``torch.load`` and DCP's reader read it.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import SourceError
from ..fileio import read_exact

ALIGNMENT = 64  # torch's data members start at multiples of this (for mmap loading)
MAX_DIRECTORY = 1 << 20  # a torch.save archive lists a handful of members
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields
_IN_ZIP64 = 0xFFFFFFFF  # a 32-bit field with this value: "see the zip64 field"
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_END = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory, 56 bytes
_LOCATOR = struct.Struct("<IIQI")  # zip64 end locator, 20 bytes
_SIG_LOCAL, _SIG_CENTRAL, _SIG_END = 0x04034B50, 0x02014B50, 0x06054B50
_SIG_END64, _SIG_LOCATOR, _SIG_DESCRIPTOR = 0x06064B50, 0x07064B50, 0x08074B50
_UTF8, _DESCRIPTOR = 0x0800, 0x0008  # flags: UTF-8 names; sizes in a data descriptor


class NeedsTorchError(Exception):
    """A valid layout this reader does not take apart (compression, another byte
    order, ...): the caller reads it with torch instead."""


@dataclass(frozen=True, slots=True)
class Member:
    """One stored member: its bytes are ``[offset, offset + nbytes)`` of the file."""

    name: str
    offset: int
    nbytes: int
    crc: int  # CRC-32 from the directory; 0 when the writer computed none


@dataclass(frozen=True)
class Archive:
    path: Path
    prefix: str  # "archive" for what torch.save wrote to a stream
    members: dict[str, Member]  # by name without the prefix: "data.pkl", "data/0"

    def read(self, name: str, limit: int, where: str) -> bytes:
        """A small member's bytes, checked against its CRC-32."""
        m = self.members.get(name)
        if m is None:
            raise SourceError(f"{where}: the torch.save archive has no {name}")
        if m.nbytes > limit:
            raise SourceError(f"{where}: {name} of {m.nbytes} bytes is larger than {limit}")
        data = read_exact(self.path, m.offset, m.nbytes, error=SourceError)
        check_crc(m, zlib.crc32(data), where)
        return data


def check_crc(m: Member, found: int, where: str) -> None:
    if m.crc and found != m.crc:
        raise SourceError(
            f"{where}: {m.name} fails its CRC-32 (stored {m.crc:08x}, the data gives "
            f"{found:08x}); the file is corrupt"
        )


def read_archive(path: Path, offset: int, length: int, where: str) -> Archive:
    """The archive at ``[offset, offset + length)`` of ``path``: every member, with
    its data's place in the file (local headers read and checked)."""
    if length < _END.size:
        raise SourceError(f"{where}: {length} bytes cannot hold a torch.save archive")
    tail = read_exact(path, offset + length - _END.size, _END.size, error=SourceError)
    sig, disk, cd_disk, _, entries, cd_size, cd_offset, comment = _END.unpack(tail)
    if sig != _SIG_END or disk or cd_disk or comment:
        raise SourceError(f"{where}: no zip end record where the archive should end")
    if _IN_ZIP64 in (cd_size, cd_offset) or entries == 0xFFFF:
        entries, cd_size, cd_offset = _end64(path, offset, length, where)
    if cd_size > MAX_DIRECTORY or cd_offset + cd_size > length - _END.size:
        raise SourceError(f"{where}: the zip directory lies outside the archive")
    directory = read_exact(path, offset + cd_offset, cd_size, error=SourceError)
    found = _entries(directory, entries, where)
    names = [n for n in found if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(names) != 1:
        raise SourceError(f"{where}: not a torch.save archive (no single PREFIX/data.pkl)")
    prefix = names[0].split("/")[0]
    members = {}
    for name, (local, nbytes, crc) in found.items():
        if not name.startswith(prefix + "/"):
            raise SourceError(f"{where}: member {name!r} is outside the archive's {prefix}/")
        start = _data_start(path, offset, length, local, name, where)
        if start + nbytes > length:
            raise SourceError(
                f"{where}: member {name} needs bytes up to {start + nbytes} of a "
                f"{length}-byte archive (truncated or lying offsets)"
            )
        members[name[len(prefix) + 1 :]] = Member(name, offset + start, nbytes, crc)
    return Archive(path, prefix, members)


def _end64(path: Path, offset: int, length: int, where: str) -> tuple[int, int, int]:
    at = length - _END.size - _LOCATOR.size
    if at < 0:
        raise SourceError(f"{where}: a zip64 archive without its zip64 locator")
    raw = read_exact(path, offset + at, _LOCATOR.size, error=SourceError)
    sig, _, end64, _ = _LOCATOR.unpack(raw)
    if sig != _SIG_LOCATOR or end64 + _END64.size > at:
        raise SourceError(f"{where}: the zip64 locator is damaged")
    raw = read_exact(path, offset + end64, _END64.size, error=SourceError)
    sig, _, _, _, _, _, _, entries, cd_size, cd_offset = _END64.unpack(raw)
    if sig != _SIG_END64:
        raise SourceError(f"{where}: no zip64 end record where the locator points")
    return entries, cd_size, cd_offset


def _entries(directory: bytes, count: int, where: str) -> dict[str, tuple[int, int, int]]:
    """name -> (local header offset, size, CRC-32) from the central directory."""
    out, pos = {}, 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise SourceError(f"{where}: the zip directory ends early")
        f = _CENTRAL.unpack_from(directory, pos)
        sig, flags, method, crc, comp, size = f[0], f[3], f[4], f[7], f[8], f[9]
        n, m, k, local = f[10], f[11], f[12], f[16]
        if sig != _SIG_CENTRAL:
            raise SourceError(f"{where}: the zip directory is damaged")
        end = pos + _CENTRAL.size + n + m + k
        if end > len(directory):
            raise SourceError(f"{where}: the zip directory ends early")
        name = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + n].decode("utf-8", "replace")
        extra = directory[pos + _CENTRAL.size + n : pos + _CENTRAL.size + n + m]
        size, comp, local = _zip64_fields(extra, size, comp, local, where)
        if flags & 1:
            raise SourceError(f"{where}: member {name} is encrypted")
        if method != 0 or comp != size:
            raise NeedsTorchError(f"member {name} is compressed")
        if name in out:
            raise SourceError(f"{where}: member {name} appears twice")
        out[name] = (local, size, crc)
        pos = end
    return out


def _zip64_fields(extra: bytes, size: int, comp: int, local: int, where: str):
    """Sizes and offset whose 32-bit fields say "see the zip64 extra field"."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + n]
        if tag == 1:
            values = [size, comp, local]
            at = 0
            for i in range(3):
                if values[i] == _IN_ZIP64:
                    if at + 8 > len(body):
                        raise SourceError(f"{where}: a zip64 field is missing")
                    values[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
            return tuple(values)
        pos += 4 + n
    return size, comp, local


def _data_start(path: Path, offset: int, length: int, local: int, name: str, where: str) -> int:
    """Where a member's data starts, from its local header (relative to the archive)."""
    if local + _LOCAL.size > length:
        raise SourceError(f"{where}: member {name}'s header lies outside the archive")
    f = _LOCAL.unpack(read_exact(path, offset + local, _LOCAL.size, error=SourceError))
    n, m = f[9], f[10]
    raw = read_exact(path, offset + local + _LOCAL.size, n, error=SourceError) if n else b""
    if f[0] != _SIG_LOCAL or raw.decode("utf-8", "replace") != name:
        raise SourceError(f"{where}: member {name}'s local header is damaged")
    return local + _LOCAL.size + n + m


# ---------------------------------------------------------------- writing


def _padding(cursor: int, name: bytes, size: int) -> tuple[bytes, bool]:
    """The local header's extra field: torch's ``FB`` padding that puts the data at a
    multiple of ``ALIGNMENT`` (after a zip64 field where the member needs one)."""
    zip64 = size >= ZIP64_LIMIT or cursor >= ZIP64_LIMIT
    start = cursor + _LOCAL.size + len(name) + 4
    z64 = b""
    if zip64:
        fields = (struct.pack("<QQ", size, size) if size >= ZIP64_LIMIT else b"") + (
            struct.pack("<Q", cursor) if cursor >= ZIP64_LIMIT else b""
        )
        z64 = struct.pack("<HH", 1, len(fields)) + fields
        start += len(z64)
    pad = -start % ALIGNMENT
    return z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad, zip64


def _descriptor_size(nbytes: int, zip64: bool) -> int:
    return 0 if not nbytes else 24 if zip64 else 16


@dataclass(frozen=True, slots=True)
class _Planned:
    name: bytes
    header_at: int
    data_at: int
    nbytes: int
    extra: bytes
    zip64: bool


class ArchiveWriter:
    """One ``torch.save`` archive at offset 0 of a new file, laid out up front: write
    each member's data (``write``, or a copy into ``[data_at(name), +nbytes)``), then
    ``finish`` with every member's CRC-32."""

    def __init__(self, members: list[tuple[str, int]], prefix: str = "archive"):
        self.prefix = prefix
        self.records = [name for name, _ in members if name != SERIALIZATION_ID]  # id hashes these
        self.sizes = dict(members)
        self.planned: list[_Planned] = []
        cursor = 0
        for name, nbytes in members:
            raw = f"{prefix}/{name}".encode()
            extra, zip64 = _padding(cursor, raw, nbytes)
            data_at = cursor + _LOCAL.size + len(raw) + len(extra)
            self.planned.append(_Planned(raw, cursor, data_at, nbytes, extra, zip64))
            cursor = data_at + nbytes + _descriptor_size(nbytes, zip64)
        self.directory_at = cursor
        self.directory = sum(_CENTRAL.size + len(p.name) + self._z64_len(p) for p in self.planned)
        self.nbytes = self.directory_at + self.directory + _END64.size + _LOCATOR.size + _END.size
        self._by_name = {p.name.decode()[len(prefix) + 1 :]: p for p in self.planned}

    @staticmethod
    def _flags(p: _Planned) -> int:
        return _UTF8 | (_DESCRIPTOR if p.nbytes else 0)  # torch: an empty record has none

    @staticmethod
    def _z64_len(p: _Planned) -> int:
        n = (16 if p.nbytes >= ZIP64_LIMIT else 0) + (8 if p.header_at >= ZIP64_LIMIT else 0)
        return 4 + n if n else 0

    def data_at(self, name: str) -> int:
        return self._by_name[name].data_at

    def headers(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) of every local header."""
        out = []
        for p in self.planned:
            head = _LOCAL.pack(
                _SIG_LOCAL, 0, self._flags(p), 0, 0, 0, 0, 0, 0, len(p.name), len(p.extra)
            )
            out.append((p.header_at, head + p.name + p.extra))
        return out

    def trailer(self, crcs: dict[str, int]) -> list[tuple[int, bytes]]:
        """(offset, bytes) of every data descriptor, the directory and the end records."""
        out, directory = [], b""
        for p in self.planned:
            crc = crcs[p.name.decode()[len(self.prefix) + 1 :]]
            if p.nbytes:
                sizes = struct.pack("<QQ" if p.zip64 else "<II", p.nbytes, p.nbytes)
                out.append((p.data_at + p.nbytes, struct.pack("<II", _SIG_DESCRIPTOR, crc) + sizes))
            directory += self._central(p, crc)
        end64_at = self.directory_at + len(directory)
        count = len(self.planned)
        end64 = _END64.pack(
            _SIG_END64, 44, 798, 45, 0, 0, count, count, len(directory), self.directory_at
        )
        locator = _LOCATOR.pack(_SIG_LOCATOR, 0, end64_at, 1)
        cd_at = self.directory_at if self.directory_at < ZIP64_LIMIT else _IN_ZIP64
        cd_size = len(directory) if len(directory) < ZIP64_LIMIT else _IN_ZIP64
        end = _END.pack(_SIG_END, 0, 0, count, count, cd_size, cd_at, 0)
        out.append((self.directory_at, directory + end64 + locator + end))
        return out

    def _central(self, p: _Planned, crc: int) -> bytes:
        fields = b""
        size, local = p.nbytes, p.header_at
        if p.nbytes >= ZIP64_LIMIT:
            fields += struct.pack("<QQ", p.nbytes, p.nbytes)
            size = _IN_ZIP64
        if p.header_at >= ZIP64_LIMIT:
            fields += struct.pack("<Q", p.header_at)
            local = _IN_ZIP64
        extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        needed = 45 if fields else 0
        flags, n = self._flags(p), len(p.name)
        head = _CENTRAL.pack(
            _SIG_CENTRAL, 0, needed, flags, 0, 0, 0, crc, size, size, n, len(extra), 0, 0, 0, 0,
            local,
        )  # fmt: skip
        return head + p.name + extra


def torch_members(storages: list[tuple[str, int]], pickled: int) -> list[tuple[str, int]]:
    """The members of a ``torch.save`` archive in torch's order: ``data.pkl`` of
    ``pickled`` bytes, then the format records, each storage, the version and id."""
    return [
        ("data.pkl", pickled),
        (".format_version", len(FORMAT_VERSION)),
        (".storage_alignment", len(STORAGE_ALIGNMENT)),
        ("byteorder", len(BYTEORDER)),
        *((f"data/{key}", n) for key, n in storages),
        ("version", len(VERSION)),
        (SERIALIZATION_ID, 40),
    ]


SERIALIZATION_ID = ".data/serialization_id"
FORMAT_VERSION = b"1"
STORAGE_ALIGNMENT = str(ALIGNMENT).encode()
BYTEORDER = b"little"
VERSION = b"3\n"


def serialization_id(crcs: dict[str, int], sizes: dict[str, int]) -> bytes:
    """The id torch's writer records last: 20 digits of a hash of the record names,
    then 20 of a hash of the CRC-32s of the records that hold bytes (``crcs``: every
    other member in write order), each combined as c10's ``hash_combine`` does; the
    names in reverse order of writing, as torch's ``unordered_set`` of written names
    yields them (for one storage or none: ``tests/sources/test_torch_archive.py`` compares
    whole archives with torch's)."""
    names = 0
    for name in reversed(list(crcs)):
        names = _hash_combine(names, _std_hash(name.encode()))
    data = 0
    for name, crc in crcs.items():
        if sizes[name]:
            data = _hash_combine(data, crc)
    return f"{names:020d}{data:020d}".encode()


_U64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _U64)) & _U64


def _std_hash(data: bytes, seed: int = 0xC70F6907) -> int:
    """libstdc++'s ``std::hash<std::string>`` (``_Hash_bytes``, 64-bit)."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995
    n = len(data)
    aligned = n & ~7
    h = (seed ^ (n * mul)) & _U64
    for i in range(0, aligned, 8):
        word = struct.unpack_from("<Q", data, i)[0]
        h = ((h ^ ((_shift_mix((word * mul) & _U64) * mul) & _U64)) * mul) & _U64
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * mul) & _U64
    return _shift_mix((_shift_mix(h) * mul) & _U64)


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)
