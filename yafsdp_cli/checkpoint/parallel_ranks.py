"""Rank files of a sharded set written side by side, when every byte comes from a file.

The kernel copies into one file at one core's speed, and the copies into
different files do not wait for each other (``python -m benchmarks.run convert``
and ``convert_optim`` time the sharded commands, and ``two_writers`` sets two writers
against one in the same run; docs/checkpoints.md, "Copying at the speed of cp"). So
when the source hands out only
file ranges and zeros (a safetensors or DCP source, a flat checkpoint),
``flat_writer`` lists each buffer's pieces once (a few per tensor) and cuts them
at the shard boundaries, and ``write_side_by_side``'s ``WRITERS`` threads each
take the next rank file and write it whole, in slot order, with a ``Copier`` of
their own that shares the caller's ledger and reads each range back for its
checksum after copying it: the two writers already keep two cores busy, and a
third thread per range to read back meanwhile only competes with them. Sources
whose bytes stream (a ``.pt`` state dict) keep the one-file-at-a-time path of
``flat_writer``, since their chunks are valid only until the next is read.

The writers pass their byte counts to the calling thread, which reports progress
(the bars are not thread-safe) and receives Ctrl-C: an error there stops the
writers at their next piece (a kernel copy step is at most ``file_ranges.KERNEL_STEP``
bytes), waits for them and re-raises. The first error of any writer is raised
once every writer has stopped.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

from .file_ranges import Copier, coalesce
from .writer import FileWriter

WRITERS = 2  # threads; at most one per core and one per rank file


def writers_for(shards: int) -> int:
    """How many threads write ``shards`` rank files (1: write them in turn)."""
    return min(WRITERS, os.cpu_count() or 1, shards)


class _Stopped(Exception):  # noqa: N818 - a signal between threads, not an error
    """Raised inside a writer thread when another thread failed or Ctrl-C came."""


def write_side_by_side(
    writers: list[FileWriter],
    contents: list[list[tuple[str, list]]],
    copier: Copier,
    tick: Callable[[int], None] | None,
    threads: int,
) -> None:
    """Write ``contents[r]`` (``(slot name, pieces)`` in slot order) into
    ``writers[r]`` for every rank, ``threads`` files at a time."""
    todo = iter(range(len(writers)))
    lock, stop = threading.Lock(), threading.Event()
    counts: queue.SimpleQueue = queue.SimpleQueue()  # bytes done; None: a writer ended
    errors: list[BaseException] = []

    def counted(n: int) -> None:
        if stop.is_set():
            raise _Stopped
        counts.put(n)

    def work() -> None:
        mine = Copier()
        mine.ledger = copier.ledger  # shared: dict writes of distinct ranges
        mine.overlap = False  # the other writer keeps the second core busy
        try:
            while not stop.is_set():
                with lock:
                    r = next(todo, None)
                if r is None:
                    return
                w = writers[r]
                for name, pieces in contents[r]:
                    w.begin(name)
                    for piece in coalesce(pieces):
                        w.put(piece, mine, counted)
                    w.end()
                w.suspend()
        except _Stopped:
            pass
        except BaseException as exc:  # handed to the calling thread
            errors.append(exc)
            stop.set()
        finally:
            counts.put(None)

    pool = [threading.Thread(target=work, name=f"yafsdp-writer-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    try:
        ended = 0
        while ended < len(pool):
            n = counts.get()
            if n is None:
                ended += 1
            elif tick is not None and not stop.is_set():
                tick(n)
    finally:
        stop.set()  # an error in ``tick``, or Ctrl-C: the writers stop at their next piece
        for t in pool:
            t.join()
    if errors:
        raise errors[0]
