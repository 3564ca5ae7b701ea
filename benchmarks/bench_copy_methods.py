"""How to move checkpoint bytes: the measurements behind ``checkpoint/file_ranges.py``.

Copies the 1.24 GiB benchmark checkpoint (bench_convert) whole, file to file, in
this process, each way below, beside ``cp`` of the same file in the same run. Every
way runs once per round, in a shuffled order, REPEAT rounds; before each copy the
previous output is deleted and ``sync`` run (outside the timing). Each copy may
reuse the page-cache pages that the deleted output left (fast) or not (on a VM that
hands free pages back to its host, slow): the shuffled order spreads that over the
ways. No bar: this is the evidence for the choice (docs/checkpoints.md, "Copying at
the speed of cp"). Each line gives the wall time and the CPU time (user + system,
every thread, cp's too): on a machine shared with other jobs the CPU time is the
steadier figure.

Ways with a checksum give the CRC-32 that ``convert`` stores; ``cp`` computes none.

* ``copy_file_range`` alone, no checksum, with the output's blocks allocated first
  (``fallocate``, what ``Copier`` does) and without; ``sendfile`` the same way (the
  fallback where ``copy_file_range`` is refused, e.g. across file systems);
* ``copy_file_range``, then the CRC read back from the page cache (two passes in
  one thread), and with the read back in a second thread meanwhile (what ``Copier``
  does), also without ``fallocate``, and with the output shifted by 100 bytes, so
  that no page of the output lines up with a page of the input (what a flat file
  whose header is not padded to the source's page offset gets, ``writer.py``);
* the same, the output 8 KiB in (on the page, off the 64 KiB grid, as a file whose
  header is 8 KiB long has it): with the first call ending on the output's next
  64 KiB boundary (what ``Copier`` does, ``file_ranges.WRITE_ALIGN``) and without;
* one buffered pass: ``preadv`` into a 4 MiB buffer, CRC-32, ``pwrite`` (what
  ``Copier`` does where no kernel copy works); the same with zlib's CRC-32 instead
  of isal's (``checkpoint/crc.py``);
* ``O_DIRECT``: 4 MiB chunks read into page-aligned buffers and CRC'd there, each
  written with ``O_DIRECT`` by a second thread while the next is read, so the output
  bypasses the page cache (written here, not in ``yafsdp_cli``: the library does not
  use it).
"""

from __future__ import annotations

import mmap
import os
import queue
import random
import resource
import statistics
import subprocess
import threading
import time
from pathlib import Path

from yafsdp_cli.checkpoint import crc as crc_mod
from yafsdp_cli.checkpoint import file_ranges
from yafsdp_cli.checkpoint.file_ranges import Copier, FileRange
from yafsdp_cli.checkpoint.format import Checksum

from .bench_convert import make_checkpoint
from .common import DATA, MiB

REPEAT = 7
SHIFTED = "the same, output off the page"
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to the device's block


SHIFT = 100  # bytes: the output's offset in the page-shifted way
OFF_GRID = 8192  # bytes: the output's offset in the two off-the-grid ways
LEAD = "output 8 KiB in, lead step (yafsdp)"
NO_LEAD = "output 8 KiB in, no lead step"
AT = {SHIFTED: SHIFT, LEAD: OFF_GRID, NO_LEAD: OFF_GRID}  # the others copy to offset 0


def _copy_into(out: Path, size: int, work) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        work(fd)
    finally:
        os.close(fd)


def direct_copy(src: Path, out: Path, fd: int, chunk: int = 4 * MiB) -> int:
    """``src`` into ``out`` (open as ``fd``, already sized) with ``O_DIRECT`` writes by
    a second thread, double-buffered; the CRC-32. The unaligned tail goes through
    ``fd`` (the page cache)."""
    size = src.stat().st_size
    aligned = size // ALIGN * ALIGN
    dfd = os.open(out, os.O_WRONLY | os.O_DIRECT)
    free: queue.Queue = queue.Queue()
    for _ in range(2):
        free.put(mmap.mmap(-1, chunk))
    jobs: queue.Queue = queue.Queue()

    def write() -> None:
        while (job := jobs.get()) is not None:
            buf, pos, n = job
            view = memoryview(buf)[:n]
            done = 0
            while done < n:
                done += os.pwrite(dfd, view[done:], pos + done)
            free.put(buf)

    writer = threading.Thread(target=write)
    writer.start()
    crc = 0
    sfd = os.open(src, os.O_RDONLY)
    try:
        for pos in range(0, aligned, chunk):
            buf = free.get()
            n = min(chunk, aligned - pos)
            got = os.preadv(sfd, [memoryview(buf)[:n]], pos)
            assert got == n, "short read"
            crc = crc_mod.crc32(memoryview(buf)[:n], crc)
            jobs.put((buf, pos, n))
        tail = os.pread(sfd, size - aligned, aligned)
        os.pwrite(fd, tail, aligned)
        crc = crc_mod.crc32(tail, crc)
    finally:
        jobs.put(None)
        writer.join()
        os.close(sfd)
        os.close(dfd)
    return crc


def methods(src: Path, out: Path) -> dict:
    size = src.stat().st_size
    whole = FileRange(src, 0, size)

    def kernel(fd, disable=(), reserve=True):
        c = Copier()
        c.disabled.update(disable)
        c.reserve = reserve
        c.copy(whole, fd, 0)

    def kernel_then_crc(fd):
        kernel(fd)
        Copier().hash(whole, Checksum())

    def kernel_with_crc_thread(fd, reserve=True, at=0):  # what Copier.copy does with a digest
        c = Copier()
        c.reserve = reserve
        c.copy(whole, fd, at, Checksum())

    def without_lead_step(fd):
        align, file_ranges.WRITE_ALIGN = file_ranges.WRITE_ALIGN, 1  # every call a full step
        try:
            kernel_with_crc_thread(fd, at=OFF_GRID)
        finally:
            file_ranges.WRITE_ALIGN = align

    def one_pass(fd):
        c = Copier()
        c.disabled.update({"copy_file_range", "sendfile"})  # as where both are refused
        c.copy(whole, fd, 0, Checksum())

    def one_pass_zlib(fd):
        fast, crc_mod._fast_crc32 = crc_mod._fast_crc32, None
        try:
            one_pass(fd)
        finally:
            crc_mod._fast_crc32 = fast

    table = {
        "cp": None,
        "copy_file_range, no checksum": kernel,
        "the same, no fallocate": lambda fd: kernel(fd, reserve=False),
        "sendfile, no checksum": lambda fd: kernel(fd, ("copy_file_range",)),
        "copy_file_range, then CRC read back": kernel_then_crc,
        "copy_file_range + CRC thread (yafsdp)": kernel_with_crc_thread,
        "the same, no fallocate ": lambda fd: kernel_with_crc_thread(fd, reserve=False),
        SHIFTED: lambda fd: kernel_with_crc_thread(fd, at=SHIFT),
        LEAD: lambda fd: kernel_with_crc_thread(fd, at=OFF_GRID),
        NO_LEAD: without_lead_step,
        "one buffered pass with CRC": one_pass,
        "the same, zlib CRC": one_pass_zlib,
        "O_DIRECT writes with CRC": lambda fd: direct_copy(src, out, fd),
    }
    sizes = {k: size + AT.get(k, 0) for k in table}
    return {
        k: (lambda w=w, n=sizes[k]: _copy_into(out, n, w)) if w else None for k, w in table.items()
    }


def _cpu_s() -> float:
    """User + system CPU of this process (every thread) and of waited-for children (cp)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _check(name: str, out: Path, at: int, want: FileRange, crc: int) -> None:
    """Every way must copy the bytes, or its time means nothing (not timed)."""
    if Copier().crc_of(FileRange(out, at, want.nbytes)) != crc:
        raise SystemExit(f"{name}: the copy's bytes differ from the input's")


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    src, out = DATA / "llama-1.2g-fp32.safetensors", DATA / "copy-methods.out"
    make_checkpoint(src)
    whole = FileRange(src, 0, src.stat().st_size)
    want = Copier().crc_of(whole)  # also warms the page cache with the input
    table = methods(src, out)
    times: dict[str, list[float]] = {k: [] for k in table}
    cpus: dict[str, list[float]] = {k: [] for k in table}
    print(f"  load average before: {os.getloadavg()[0]:.2f}; CRC backend {crc_mod.backend()}")
    rng = random.Random(0)
    for _ in range(REPEAT):
        order = list(table)
        rng.shuffle(order)
        for name in order:
            if out.exists():
                out.unlink()
            os.sync()
            cpu, start = _cpu_s(), time.perf_counter()
            if table[name] is None:
                subprocess.run(["cp", str(src), str(out)], check=True)
            else:
                table[name]()
            times[name].append(time.perf_counter() - start)
            cpus[name].append(_cpu_s() - cpu)
            _check(name, out, AT.get(name, 0), whole, want)
    out.unlink()
    cp = statistics.median(times["cp"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(
            f"  {name:<38} median {m:.3f} s ({m / cp:.2f}x cp), min {min(ts):.3f} s; "
            f"CPU median {statistics.median(cpus[name]):.3f} s, min {min(cpus[name]):.3f} s"
        )
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    return True


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
