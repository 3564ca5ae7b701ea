"""Long ranges written two ways, whichever is faster now: the kernel copy or
direct writes.

``SplitCopy`` cuts a range into ``CHUNK``-long pieces and sends each one way:

* kernel: ``copy_file_range`` into the page cache, the CRC then read back from the
  source's page cache by a worker thread while the next chunk is copied;
* direct: the chunk read into a page-aligned buffer and CRC'd there, then written
  by the worker with ``O_DIRECT`` (no page cache: the device reads the buffer)
  while the next chunk is read.

Why: writing into the page cache costs a core a memcpy into newly allocated pages.
On a VM that hands free pages back to its host that cost swings from 0.27 s to over
5 s per 1.24 GiB, run to run: fast when the pages of a file just deleted are
reused, slow when they must come back from the host. Direct writes do not touch
the page cache: 0.40-0.50 s for the same file, steady. So
``Rates`` times both ways and the faster takes the chunks; direct writes take over
only from a kernel copy ``DIRECT_MARGIN`` times slower (where the page cache is
fast, as on most machines, the output then stays in it, as ``cp``'s does). The
losing way is timed again now and then, less often each time it still loses.
Figures: ``python -m benchmarks.run copy_methods``; docs/checkpoints.md, "Copying
at the speed of cp".

A direct write and a kernel copy into one file do not overlap: ext4 holds the
file's lock through a direct write into new blocks, so a kernel copy is timed only
when no direct write is in flight.

``O_DIRECT`` needs the file offset, length and buffer aligned to the device's
block; ``ALIGN`` (4 KiB) is a multiple of every common one. Only the aligned middle
of a range may go direct; its unaligned head and tail (under 4 KiB each) take the
kernel copy first, so no 4 KiB page of the output is written both ways. A file
system that refuses ``O_DIRECT`` (``EINVAL`` at open or at the first write) is not
asked again; the chunk is copied the kernel's way. The chunk CRCs are combined in
order (``crc32_combine``), holes included (``crc32_zeros``, never read nor
written), so the range's CRC is the one a single pass would give.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import CheckpointError
from ..fileio import OUTPUT_FULL
from .crc import crc32, crc32_combine, crc32_zeros

ALIGN = 4096  # O_DIRECT: file offsets, lengths and buffers aligned to this
CHUNK = 4 * 1024 * 1024  # bytes sent one way at a time
SPLIT_MIN = 1024 * 1024  # ranges this long are split
DIRECT_MARGIN = 2.0  # direct writes take over only from a kernel copy this much slower
RETIME_EVERY = 8  # the losing way is timed again after this many chunks, twice as
RETIME_MAX = 256  # many each time it still loses, up to this
# errno values of a write that mean "no O_DIRECT here", not "the write failed"
REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}

O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(slots=True)
class Chunk:
    """``nbytes`` from source offset ``src`` to output offset ``dst``; ``direct``: may
    be written with O_DIRECT (aligned); ``hole``: zeros, nothing to copy."""

    src: int
    dst: int
    nbytes: int
    direct: bool = False
    hole: bool = False
    crc: int | None = None
    done: bool = False


def plan(segments, src_offset: int, dst_offset: int) -> list[Chunk]:
    """Chunks covering ``segments`` (``(start, length, is_data)`` of the source, as
    ``copy.data_segments`` gives them), in order; the aligned middle of each data
    segment in ``CHUNK`` pieces that may go direct."""
    chunks = []
    for start, n, is_data in segments:
        at = dst_offset + start - src_offset
        if not is_data:
            chunks.append(Chunk(start, at, n, hole=True))
            continue
        lo = min(at + n, -(-at // ALIGN) * ALIGN)
        hi = max(lo, (at + n) // ALIGN * ALIGN)
        if lo > at:
            chunks.append(Chunk(start, at, lo - at))
        for pos in range(lo, hi, CHUNK):
            chunks.append(Chunk(start + pos - at, pos, min(CHUNK, hi - pos), direct=True))
        if at + n > hi:
            chunks.append(Chunk(start + hi - at, hi, at + n - hi))
    return chunks


def open_direct(path) -> int | None:
    """A second descriptor of the output with O_DIRECT; None where refused."""
    if not O_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | O_DIRECT)
    except OSError as exc:
        if exc.errno in OUTPUT_FULL:
            raise
        return None


def buffers() -> list[mmap.mmap]:
    """Three page-aligned buffers (anonymous mmaps) of ``CHUNK`` bytes for a
    ``SplitCopy``: one the worker reads back into, two for direct writes."""
    return [mmap.mmap(-1, CHUNK) for _ in range(3)]


class Rates:
    """Seconds per byte of each way of writing, a running average over the chunks
    timed, kept for a whole command: the way that wins takes the chunks, and the
    other is timed again after ``retime_every`` chunks (the page cache's speed
    swings), which doubles, up to ``RETIME_MAX``, each time it still loses."""

    def __init__(self):
        self.kernel: float | None = None
        self.direct: float | None = None
        self.since_retime = 0  # chunks since the losing way was last timed
        self.retime_every = RETIME_EVERY

    def note(self, way: str, seconds: float, nbytes: int, *, retime: bool = False) -> None:
        rate = seconds / max(nbytes, 1)
        old = getattr(self, way)
        setattr(self, way, rate if old is None else (old + rate) / 2)
        if retime and self.kernel is not None and self.direct is not None:
            still_loses = self.best() != way
            self.retime_every = (
                min(2 * self.retime_every, RETIME_MAX) if still_loses else RETIME_EVERY
            )
            self.since_retime = 0

    def best(self) -> str:
        return "direct" if self.direct * DIRECT_MARGIN < self.kernel else "kernel"

    def choose(self) -> tuple[str, bool]:
        """The way for the next chunk, and whether it is a retime of the loser."""
        if self.kernel is None:
            return "kernel", True  # the command's first chunk: the kernel copy, timed
        if self.direct is None:
            return "direct", True  # then one chunk written direct, timed
        best = self.best()
        self.since_retime += 1
        if self.since_retime >= self.retime_every:
            return ("kernel" if best == "direct" else "direct"), True
        return best, False


class SplitCopy:
    """One range's chunks, taken in order by this thread, which for each chunk picks
    the way that ``Rates`` says is faster:

    * kernel: this thread copies the chunk (``copy``) and hands it to the worker,
      which reads it back for its CRC (this thread goes on copying meanwhile);
    * direct: this thread reads the chunk into one of two page-aligned buffers and
      CRCs it there, and the worker writes that buffer with O_DIRECT (this thread
      reads the next chunk meanwhile).

    A direct write into new blocks holds the file's lock (ext4), so a kernel copy
    is timed only when no direct write is in flight (this thread waits for that),
    and a direct write that retimes its way is waited for before the next kernel
    copy. The unaligned heads and tails go first, before any direct write. ``run``
    returns the range's CRC (0 unless ``want_crc``); ``mode`` fixes the way (tests)."""

    def __init__(
        self,
        chunks: list[Chunk],
        src_fd: int,
        src_path,
        direct_fd: int,
        buffers: list[mmap.mmap],
        rates: Rates,
        *,
        want_crc: bool,
        copy: Callable[[Chunk], None],
        count: Callable[[str, int], None],
        mode: str | None = None,
    ):
        self.chunks = chunks
        self.src_fd, self.src_path, self.direct_fd = src_fd, src_path, direct_fd
        self.rates = rates
        self.want_crc = want_crc
        self.copy = copy  # the kernel copy of one chunk
        self.count = count
        self.forced = mode  # "kernel" or "direct": every aligned chunk that way (tests)
        self.refused = False  # a direct write was refused: no O_DIRECT on this file system
        self._read_buf = memoryview(buffers[0])  # the worker's, for reading back
        self._free = [memoryview(b) for b in buffers[1:]]  # for direct writes
        self._cond = threading.Condition()
        self._jobs: deque = deque()  # ("crc", chunk) or ("write", chunk, buffer)
        self._busy = False  # the worker is on a job
        self._writes = 0  # direct writes queued or in flight
        self._done = False
        self._error: BaseException | None = None

    def run(self, tick=None) -> int:
        worker = threading.Thread(target=self._work, name="yafsdp-direct", daemon=True)
        worker.start()
        try:
            for c in self.chunks:  # the unaligned heads and tails first: no direct
                if not c.hole and not c.direct:  # write is in flight yet to wait for
                    self._kernel(c)
                    if tick:
                        tick(c.nbytes)
            for c in self.chunks:
                if c.hole or not c.direct:
                    continue
                self._raise_worker_error()
                if self.refused:
                    self._kernel(c)
                elif self.forced:
                    (self._direct if self.forced == "direct" else self._kernel)(c)
                else:
                    way, retime = self.rates.choose()
                    if way == "kernel":
                        self._kernel(c, timed=True, retime=retime)
                    else:
                        self._direct(c, retime=retime)
                if tick:
                    tick(c.nbytes)
            self._idle()
        except BaseException:
            with self._cond:
                self._jobs.clear()  # an error or Ctrl-C: the worker ends after its job
            raise
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
            worker.join()
        self._raise_worker_error()
        for c in self.chunks:  # refused by O_DIRECT after all: the kernel copy, and
            if not c.hole and not c.done:  # the read back here (the worker has ended)
                self.copy(c)
                c.done = True
                if self.want_crc:
                    c.crc = self._read(c, self._read_buf)
        return self._combine()

    def _kernel(self, c: Chunk, *, timed: bool = False, retime: bool = False) -> None:
        if timed:
            self._no_writes()  # none in flight: they share the file's lock
        start = time.perf_counter()
        self.copy(c)
        if timed:
            self.rates.note("kernel", time.perf_counter() - start, c.nbytes, retime=retime)
        c.done = True
        if self.want_crc:
            self._give(("crc", c))  # the worker reads it back; this thread goes on

    def _direct(self, c: Chunk, *, retime: bool = False) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._error is not None)
            if self._error is not None:
                return
            buf = self._free.pop()
        try:
            crc = self._read(c, buf)
        except BaseException:
            with self._cond:
                self._free.append(buf)
            raise
        if self.want_crc:
            c.crc = crc
        self._give(("write", c, buf, retime))
        if retime:
            self._no_writes()  # timed alone: no kernel copy holds the file's lock meanwhile

    def _give(self, job) -> None:
        with self._cond:
            self._jobs.append(job)
            if job[0] == "write":
                self._writes += 1
            self._cond.notify_all()

    def _no_writes(self) -> None:
        """Wait until no direct write is queued or in flight."""
        self._wait_for(lambda: not self._writes)

    def _idle(self) -> None:
        """Wait until the worker has nothing to do."""
        self._wait_for(lambda: not self._jobs and not self._busy)

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: ready() or self._error is not None)

    def _raise_worker_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _combine(self) -> int:
        crc = 0
        for c in self.chunks:
            if c.hole:
                crc = crc32_zeros(crc, c.nbytes)
            elif self.want_crc:
                crc = crc32_combine(crc, c.crc, c.nbytes)
        return crc

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._done:
                    self._cond.wait()
                if not self._jobs or self._error is not None:
                    return  # done, or an error that the calling thread will raise
                job = self._jobs.popleft()
                self._busy = True
            try:
                if job[0] == "crc":
                    job[1].crc = self._read(job[1], self._read_buf)
                else:
                    self._write(job[1], job[2], job[3])
            except BaseException as exc:  # handed to the calling thread
                with self._cond:
                    self._error = exc
                    self._jobs.clear()
            finally:
                with self._cond:
                    self._busy = False
                    if job[0] == "write":
                        self._free.append(job[2])
                        self._writes -= 1
                    self._cond.notify_all()

    def _read(self, c: Chunk, buf: memoryview) -> int:
        """``c``'s source bytes into ``buf``; their CRC-32 (0 unless ``want_crc``)."""
        view = buf[: c.nbytes]
        got = 0
        while got < c.nbytes:
            try:
                n = os.preadv(self.src_fd, [view[got:]], c.src + got)
            except OSError as exc:
                raise CheckpointError(f"{self.src_path}: cannot read ({exc.strerror})") from None
            if not n:
                raise CheckpointError(
                    f"{self.src_path}: ended before byte {c.src + c.nbytes} (truncated file)"
                )
            got += n
        return crc32(view) if self.want_crc else 0

    def _write(self, c: Chunk, buf: memoryview, retime: bool) -> None:
        """``buf`` to ``c``'s place with O_DIRECT, timed; a refusal leaves ``c`` undone."""
        view, put = buf[: c.nbytes], 0
        start = time.perf_counter()
        while put < c.nbytes:
            try:
                put += os.pwrite(self.direct_fd, view[put:], c.dst + put)
            except OSError as exc:
                if exc.errno in REFUSED and not put:
                    self.refused = True
                    return
                raise  # the output's error: writer.staged_output names the output
        self.rates.note("direct", time.perf_counter() - start, c.nbytes, retime=retime)
        self.count("direct", c.nbytes)
        c.done = True
