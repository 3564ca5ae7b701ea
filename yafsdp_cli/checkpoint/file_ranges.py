"""Moving checkpoint bytes by file ranges: the kernel copies, holes stay holes.

A tensor's content is a list of pieces: ``FileRange`` (bytes of a file), ``Zeros``
(padding), or plain bytes (a source with no file behind it, such as a ``.pt``
state dict). ``coalesce`` merges neighbours, so a flat buffer whose entries lie one
after the other in the source is one range. ``Copier`` moves a range into an
output file that was sized in advance (``ftruncate``), so ``Zeros`` and the holes
of a sparse source (``SEEK_DATA``/``SEEK_HOLE``) are simply not written: they read
back as zeros and stay holes.

A range's data has its output blocks allocated first (``fallocate``), then the
kernel copies it (``copy_file_range``, else ``sendfile``, else buffered reads and
writes), its first call ending on the output's 64 KiB grid (``WRITE_ALIGN``);
bytes that must be checksummed are read back from the source's page cache with
``preadv`` (not ``mmap``: a source truncated meanwhile would raise SIGBUS) and
CRC-32'd by a second thread while the kernel copies. With ``record`` the CRCs of
the input's ranges are kept in a ``Ledger``, so the check after the copy need not
read them again. Why this way and no other (one buffered pass, ``O_DIRECT``):
``python -m benchmarks.run copy_methods``, explained in docs/checkpoints.md,
"Copying at the speed of cp".

Every ``OSError`` becomes a ``CheckpointError`` naming the file; a file that ends
before its range does is reported as truncated. A full disk stays an ``OSError``:
``writer.staged_output`` names the output.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..fileio import OUTPUT_FULL, allocate
from .crc import crc32, crc32_combine, crc32_zeros

COPY_BUFFER = 4 * 1024 * 1024  # the read-back buffer, and the buffered copy's
KERNEL_STEP = 64 * 1024 * 1024  # bytes per copy_file_range/sendfile call: progress, Ctrl-C
# the kernel's copy writes 64 KiB at a time, each into folios no larger than its
# offset's alignment allows: a copy starts with a step up to the output's next
# 64 KiB boundary, so every later write fills whole large folios
WRITE_ALIGN = 64 * 1024
OVERLAP_MIN = 8 * 1024 * 1024  # ranges this long are read back by a second thread
RESERVE_MIN = 1024 * 1024  # data this long has its output blocks allocated first
# errno values that mean "this method does not work for these files", not "the copy failed"
_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}
_UNSUPPORTED |= {getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

_KERNEL_METHODS = ("copy_file_range", "sendfile")

Tick = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class FileRange:
    """Bytes ``[offset, offset + nbytes)`` of the file ``path``."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Zeros:
    """``nbytes`` zero bytes (padding)."""

    nbytes: int


def size_of(piece) -> int:
    if isinstance(piece, (FileRange, Zeros)):
        return piece.nbytes
    return memoryview(piece).nbytes


def split(piece, k: int):
    """``piece`` as its first ``k`` bytes and the rest."""
    if isinstance(piece, FileRange):
        head = FileRange(piece.path, piece.offset, k)
        return head, FileRange(piece.path, piece.offset + k, piece.nbytes - k)
    if isinstance(piece, Zeros):
        return Zeros(k), Zeros(piece.nbytes - k)
    view = memoryview(piece).cast("B")
    return view[:k], view[k:]


def coalesce(pieces: Iterable) -> Iterator:
    """Merge neighbouring ranges of one file (end of one = start of the next) and
    neighbouring zeros; drop empty pieces. Plain bytes pass through at once (a
    chunk may be valid only until the next one is read)."""
    pending = None
    for p in pieces:
        if not size_of(p):
            continue
        if not isinstance(p, (FileRange, Zeros)):
            if pending is not None:
                yield pending
            pending = None
            yield p
            continue
        if isinstance(pending, FileRange) and isinstance(p, FileRange):
            if p.path == pending.path and p.offset == pending.offset + pending.nbytes:
                pending = FileRange(p.path, pending.offset, pending.nbytes + p.nbytes)
                continue
        elif isinstance(pending, Zeros) and isinstance(p, Zeros):
            pending = Zeros(pending.nbytes + p.nbytes)
            continue
        if pending is not None:
            yield pending
        pending = p
    if pending is not None:
        yield pending


def data_segments(fd: int, offset: int, nbytes: int) -> Iterator[tuple[int, int, bool]]:
    """``(start, length, is_data)`` covering ``[offset, offset + nbytes)``: the holes
    of a sparse file (``SEEK_DATA``/``SEEK_HOLE``) as ``is_data=False``. Where the
    file system cannot tell, everything is data."""
    pos, end = offset, offset + nbytes
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos: a hole to the end of file
                yield pos, end - pos, False
                return
            yield pos, end - pos, True  # SEEK_DATA not supported here
            return
        if data > pos:
            yield pos, min(data, end) - pos, False
            pos = min(data, end)
            if pos == end:
                return
        hole = os.lseek(fd, pos, os.SEEK_HOLE)
        stop = min(hole, end) if hole > pos else end
        yield pos, stop - pos, True
        pos = stop


class Ledger:
    """The CRC-32 of every file range a ``Copier`` copied, so that checking the
    input afterwards reads only what was not copied (padding, replicas)."""

    def __init__(self):
        self._by_path: dict[Path, dict[tuple[int, int], int]] = {}

    def record(self, src: FileRange, crc: int) -> None:
        self._by_path.setdefault(src.path, {})[(src.offset, src.nbytes)] = crc

    def get(self, src: FileRange) -> int | None:
        return self._by_path.get(src.path, {}).get((src.offset, src.nbytes))

    def within(self, path: Path, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """``(offset, nbytes, crc)`` of the recorded ranges inside ``[offset, offset +
        nbytes)`` of ``path``, in order."""
        end = offset + nbytes
        found = self._by_path.get(path, {})
        return sorted((a, n, c) for (a, n), c in found.items() if a >= offset and a + n <= end)


class Copier:
    """Copies ranges into output files; one per command (it holds one buffer and
    remembers which kernel methods failed). With ``record`` it keeps a ``Ledger``."""

    def __init__(self, buffer_bytes: int = COPY_BUFFER, *, record: bool = False):
        self._size = buffer_bytes
        self._view: memoryview | None = None
        self.ledger = Ledger() if record else None
        self.disabled: set[str] = set()  # "copy_file_range", "sendfile"
        self._stop: threading.Event | None = None  # set: a reading thread should stop
        self.used: dict[str, int] = {}  # method -> bytes moved with it
        self.reserve = True  # allocate output blocks before copying (off once refused)
        self.overlap = True  # read back on a second thread while the kernel copies

    def _buffer(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(bytearray(self._size))
        return self._view

    def _count(self, method: str, n: int) -> None:
        self.used[method] = self.used.get(method, 0) + n

    def copy(self, src: FileRange, dst_fd: int, dst_off: int, digest=None, tick=None) -> None:
        """``src``'s bytes to ``dst_fd`` at ``dst_off`` (which must already be that
        long, so skipped holes read as zeros); ``digest`` is extended by them.

        The kernel copies; bytes that must be checksummed (a digest, or a ledger
        that lacks them) are read back from the page cache meanwhile. Where no
        kernel method works, one buffered pass copies and checksums."""
        known = self.ledger.get(src) if self.ledger is not None else None
        want = known is None and (digest is not None or self.ledger is not None)
        if not want:
            self._pass(src, dst_fd, dst_off, tick, kernel=True)
        elif self.kernel_available():
            known = self._copy_and_read_back(src, dst_fd, dst_off, tick)
        else:
            known = self._pass(src, dst_fd, dst_off, tick)
        if want and self.ledger is not None:
            self.ledger.record(src, known)
        if digest is not None:
            digest.extend(known, src.nbytes)

    def _copy_and_read_back(self, src: FileRange, dst_fd, dst_off, tick) -> int:
        """The kernel copy, and the CRC of the same bytes read from the page cache by a
        second thread meanwhile (both release the GIL: two cores, one wall time)."""
        if src.nbytes < OVERLAP_MIN or self._stop is not None or not self.overlap:
            self._pass(src, dst_fd, dst_off, tick, kernel=True)
            return self.crc_of(src)
        reader = Copier(self._size)
        reader._stop = threading.Event()
        box: dict = {}

        def read_back() -> None:
            try:
                box["crc"] = reader.crc_of(src)
            except BaseException as exc:  # handed to the main thread below
                box["error"] = exc

        thread = threading.Thread(target=read_back, name="yafsdp-crc", daemon=True)
        thread.start()
        try:
            self._pass(src, dst_fd, dst_off, tick, kernel=True)
        except BaseException:
            reader._stop.set()  # an error or Ctrl-C here: do not wait for all of it
            raise
        finally:
            thread.join()
        if "error" in box:
            raise box["error"]
        return box["crc"]

    def kernel_available(self) -> bool:
        return any(hasattr(os, m) and m not in self.disabled for m in _KERNEL_METHODS)

    def _pass(self, src: FileRange, dst_fd, dst_off, tick, kernel: bool = False) -> int:
        """Copy ``src`` segment by segment (holes skipped); its CRC-32 unless ``kernel``."""
        fd, crc = open_range(src), 0
        try:
            for start, n, is_data in data_segments(fd, src.offset, src.nbytes):
                at = dst_off + start - src.offset
                if not is_data:
                    crc = crc32_zeros(crc, n)
                    self._count("hole", n)
                    if tick:
                        tick(n)
                    continue
                self._reserve(dst_fd, at, n)
                if kernel:
                    self._kernel_copy(fd, src.path, start, dst_fd, at, n, tick)
                else:
                    crc = self._buffered(fd, src.path, start, dst_fd, at, n, crc, tick)
        finally:
            os.close(fd)
        return crc

    def _reserve(self, dst_fd: int, at: int, n: int) -> None:
        """Allocate the output's blocks under ``[at, at + n)`` before they are written.
        Only data is reserved, so holes stay holes. A full disk is the output's error
        (before a byte is copied); a file system without ``fallocate`` is not asked
        again."""
        if n < RESERVE_MIN or not self.reserve:
            return
        try:
            allocate(dst_fd, at, n)
        except OSError as exc:
            if exc.errno in OUTPUT_FULL:
                raise
            self.reserve = False

    def crc_of(self, src: FileRange, visit=None, tick=None) -> int:
        """The CRC-32 of ``src`` (read, not copied); ``visit(pos, chunk)`` sees each
        data chunk (``pos`` relative to ``src.offset``); holes are zeros, not read."""
        digest = _Crc()
        self.hash(src, digest, visit, tick)
        return digest.crc

    def crc_of_copied(self, src: FileRange) -> int:
        """The CRC-32 of ``src`` from the CRCs the ledger holds for ranges inside it,
        reading only the bytes between them (for a range copied in pieces, such as a
        tensor split across rank files, nothing)."""
        crc, pos, end = 0, src.offset, src.offset + src.nbytes
        known = self.ledger.within(src.path, src.offset, src.nbytes) if self.ledger else []
        for offset, n, piece in [*known, (end, 0, 0)]:
            if offset < pos:
                continue  # overlaps a range already counted (copied twice, split otherwise)
            if offset > pos:
                gap = self.crc_of(FileRange(src.path, pos, offset - pos))
                crc = crc32_combine(crc, gap, offset - pos)
            crc, pos = crc32_combine(crc, piece, n), offset + n
        return crc

    def hash(self, src: FileRange, digest, visit=None, tick=None) -> None:
        """Feed ``src``'s bytes to ``digest`` (``update``/``update_zeros``)."""
        fd = open_range(src)
        try:
            for start, n, is_data in data_segments(fd, src.offset, src.nbytes):
                if not is_data:
                    digest.update_zeros(n)
                    if tick:
                        tick(n)
                    continue
                for pos, chunk in self._read(fd, src.path, start, n):
                    digest.update(chunk)
                    if visit is not None:
                        visit(pos - src.offset, chunk)
                    if tick:
                        tick(len(chunk))
        finally:
            os.close(fd)

    def _read(self, fd: int, path: Path, offset: int, n: int) -> Iterator[tuple[int, memoryview]]:
        """Chunks of ``[offset, offset + n)`` read into the one buffer."""
        buf = self._buffer()
        while n:
            if self._stop is not None and self._stop.is_set():
                raise CheckpointError(f"{path}: reading stopped")
            want = min(n, len(buf))
            try:
                got = os.preadv(fd, [buf[:want]], offset)
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
            if not got:
                raise CheckpointError(f"{path}: ended before byte {offset + n} (truncated file)")
            yield offset, buf[:got]
            offset, n = offset + got, n - got

    def _buffered(self, fd, path, offset, dst_fd, at, n, crc: int, tick) -> int:
        for pos, chunk in self._read(fd, path, offset, n):
            crc = crc32(chunk, crc)
            write_at(dst_fd, chunk, at + pos - offset)
            self._count("buffered", len(chunk))
            if tick:
                tick(len(chunk))
        return crc

    def _kernel_copy(self, fd, path, offset, dst_fd, at, n, tick) -> None:
        for method in _KERNEL_METHODS:
            if method in self.disabled or not hasattr(os, method):
                continue
            done = self._try_kernel(method, fd, path, offset, dst_fd, at, n, tick)
            offset, at, n = offset + done, at + done, n - done
            if not n:
                return
        self._buffered(fd, path, offset, dst_fd, at, n, 0, tick)

    def _try_kernel(self, method, fd, path, offset, dst_fd, at, n, tick) -> int:
        """Bytes copied with ``method`` before it finished, stopped (a zero return:
        some file systems do that instead of failing) or proved unsupported."""
        done = 0
        while done < n:
            to_grid = -(at + done) % WRITE_ALIGN  # 0 once on the grid: full steps keep it
            step = min(n - done, to_grid or KERNEL_STEP)
            try:
                if method == "copy_file_range":
                    got = os.copy_file_range(fd, dst_fd, step, offset + done, at + done)
                else:
                    os.lseek(dst_fd, at + done, os.SEEK_SET)
                    got = os.sendfile(dst_fd, fd, offset + done, step)
            except OSError as exc:
                if exc.errno in OUTPUT_FULL:
                    raise  # the output's fault: writer.staged_output names the output
                if exc.errno not in _UNSUPPORTED:
                    raise CheckpointError(f"{path}: copy failed ({exc.strerror})") from None
                self.disabled.add(method)
                return done
            if not got:
                return done  # the buffered copy tells a truncated file from a refusal
            done += got
            self._count(method, got)
            if tick:
                tick(got)
        return done


class _Crc:
    """The smallest digest: a bare running CRC-32."""

    def __init__(self):
        self.crc = 0

    def update(self, data) -> None:
        self.crc = crc32(data, self.crc)

    def update_zeros(self, n: int) -> None:
        self.crc = crc32_zeros(self.crc, n)


def open_range(src: FileRange) -> int:
    """A descriptor of ``src.path``, which must hold the whole range: past the end
    of a file ``SEEK_DATA`` sees a hole, and a truncated file must not read as zeros."""
    try:
        fd = os.open(src.path, os.O_RDONLY)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise CheckpointError(f"{src.path}: cannot read ({exc.strerror})") from None
    if src.offset + src.nbytes > size:
        os.close(fd)
        raise CheckpointError(
            f"{src.path}: ends at byte {size}, before byte {src.offset + src.nbytes} that "
            "its header promises (truncated file)"
        )
    return fd


def write_at(fd: int, data, offset: int, path: Path | str = "the output") -> None:
    """All of ``data`` at ``offset`` (``pwrite`` may write less than asked). An
    OSError (disk full) propagates: ``writer.staged_output`` names the output."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
