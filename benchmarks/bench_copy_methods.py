"""How to move checkpoint bytes: the measurements behind ``checkpoint/copy.py``.

Copies the 1.24 GiB benchmark checkpoint (bench_convert) whole, file to file, in
this process, with each way ``Copier`` can do it, beside ``cp`` of the same file;
every method runs once per round, in a shuffled order, REPEAT rounds, each output
deleted and ``sync`` run before each copy (outside the timing). No bar: this is
the evidence for the choice (docs/checkpoints.md, "Copying at the speed of cp"). Each line
gives the wall time and the CPU time (user + system, both threads, cp's too): on
a machine shared with other jobs the CPU time is the steadier figure.

* kernel copy, no checksum (copy_file_range, sendfile), with the output's blocks
  allocated first (``fallocate``, what Copier does) and without;
* kernel copy, then the checksum read back from the page cache (two passes), and
  the same with the read back in a second thread meanwhile (what Copier does), with
  and without ``fallocate``;
* one buffered pass (preadv into one buffer, CRC-32, pwrite): what Copier does
  where neither kernel copy works;
* the same with zlib's CRC-32 instead of isal's, and with other buffer sizes;
* by 4 MiB chunks (``direct.SplitCopy``, what Copier does for a named output): each
  chunk the faster way by the running rates (what yafsdp does), and every chunk
  written with O_DIRECT, or every chunk the kernel's way with the read back in a
  second thread.

Each copy deletes the previous one's output first, so it may reuse that file's
page-cache pages (fast) or not (after a direct write there are none): the shuffled
order spreads that over the methods.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import subprocess
import time
from pathlib import Path

from yafsdp_cli.checkpoint import crc as crc_mod
from yafsdp_cli.checkpoint.copy import Copier, FileRange
from yafsdp_cli.checkpoint.format import Checksum

from .bench_convert import make_checkpoint
from .common import DATA, MiB

REPEAT = 5


def _copy_into(out: Path, size: int, work) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        work(fd)
    finally:
        os.close(fd)


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

    def kernel_with_crc_thread(fd, reserve=True):  # what Copier.copy does with a digest
        c = Copier()
        c.reserve = reserve
        c.copy(whole, fd, 0, Checksum())

    def one_pass(buffer_bytes):
        def copy(fd):
            c = Copier(buffer_bytes)
            c.disabled.update({"copy_file_range", "sendfile"})  # as where both are refused
            c.copy(whole, fd, 0, Checksum())

        return copy

    def split(mode=None):  # what Copier.copy does with a named output (direct.py)
        def copy(fd):
            c = Copier()
            c.split_mode = mode
            c.copy(whole, fd, 0, Checksum(), None, out)

        return copy

    def one_pass_zlib(fd):
        fast, crc_mod._fast_crc32 = crc_mod._fast_crc32, None
        try:
            one_pass(4 * MiB)(fd)
        finally:
            crc_mod._fast_crc32 = fast

    table = {
        "cp": None,
        "copy_file_range, no checksum": kernel,
        "the same, no fallocate": lambda fd: kernel(fd, reserve=False),
        "sendfile, no checksum": lambda fd: kernel(fd, ("copy_file_range",)),
        "copy_file_range + CRC read back": kernel_then_crc,
        "the same, read back by a 2nd thread": kernel_with_crc_thread,
        "the same, no fallocate ": lambda fd: kernel_with_crc_thread(fd, reserve=False),
        "4 MiB chunks, the faster way (yafsdp)": split(),
        "4 MiB chunks, every one direct": split("direct"),
        "4 MiB chunks, every one kernel": split("kernel"),
        "one pass, 1 MiB buffer": one_pass(MiB),
        "one pass, 4 MiB buffer": one_pass(4 * MiB),
        "one pass, 16 MiB buffer": one_pass(16 * MiB),
        "one pass, 4 MiB, zlib CRC": one_pass_zlib,
    }
    return {k: (lambda w=w: _copy_into(out, size, w)) if w else None for k, w in table.items()}


def _cpu_s() -> float:
    """User + system CPU of this process (both threads) and of waited-for children (cp)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    src, out = DATA / "llama-1.2g-fp32.safetensors", DATA / "copy-methods.out"
    make_checkpoint(src)
    Copier().hash(FileRange(src, 0, src.stat().st_size), Checksum())  # warm the cache
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
