"""Whether writing rank files side by side earns its keep: a sharded convert with two
writer threads (``checkpoint/parallel_ranks.py``) against one writer, same run.

    gain = one writer / two writers (median wall)  >= 1.1 x: keep, else drop

The input is a Llama-shaped fp32 safetensors file of pseudo-random bytes (one decoder
layer, hidden 2048, intermediate 5504, vocabulary 32000, untied head: 693 MiB), written
into a temporary folder under benchmarks/data/ (git-ignored) and removed at the end.
Each run is ``convert_checkpoint(..., LayoutOptions(world_size=8), sharded=True)`` in
this process, ``writer_threads=2`` or ``1`` (the library's switch; the command line
takes the machine's choice, two where it has two cores); the order alternates
within each of the REPEAT pairs after one warm-up of each. The input is read once
before any timing, so both paths read it warm; every output is removed and ``sync``
run before each run (outside the timing), so no writeback of an earlier run
competes. The CPU time of each run (this process, user + system) is printed beside
its wall time: on a machine shared with other jobs the wall time also measures the
queue for a core.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from .bench_convert import make_checkpoint
from .common import DATA, MiB

LAYERS = 1  # bench_convert's shapes with one decoder layer: 693 MiB
WORLD_SIZE = 8
REPEAT = 7
BAR = 1.1  # the gain two writers must show over one to keep their code path


def _run(src: Path, out: Path, threads: int) -> tuple[float, float]:
    """Wall and CPU seconds of one sharded convert into ``out`` (removed first)."""
    from yafsdp_cli.checkpoint import convert_checkpoint
    from yafsdp_cli.options import LayoutOptions

    if out.exists():
        shutil.rmtree(out)
    os.sync()
    cpu, start = time.process_time(), time.perf_counter()
    convert_checkpoint(
        src, out, LayoutOptions(world_size=WORLD_SIZE), sharded=True, writer_threads=threads
    )
    return time.perf_counter() - start, time.process_time() - cpu


def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def main() -> bool:
    DATA.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=DATA))
    try:
        src = scratch / "llama-fp32.safetensors"
        make_checkpoint(src, LAYERS)
        return _measure(src, scratch / "out")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(src: Path, out: Path) -> bool:
    _warm(src)
    print(
        f"two_writers: sharded convert -n {WORLD_SIZE} of {src.stat().st_size / MiB:.0f} MiB "
        f"(fp32, Llama-shaped, {LAYERS} decoder layer), median of {REPEAT} pairs; "
        f"{os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f} before"
    )
    _run(src, out, 2)  # warm-up of each: imports, first allocations
    _run(src, out, 1)
    runs: dict[int, list[tuple[float, float]]] = {2: [], 1: []}
    for i in range(REPEAT):
        for threads in (2, 1) if i % 2 else (1, 2):
            runs[threads].append(_run(src, out, threads))
    shutil.rmtree(out, ignore_errors=True)
    wall = {t: statistics.median(w for w, _ in r) for t, r in runs.items()}
    cpu = {t: statistics.median(c for _, c in r) for t, r in runs.items()}
    for t, label in ((2, "two writers"), (1, "one writer ")):
        each = ", ".join(f"{w:.3f}" for w, _ in runs[t])
        print(f"  {label}  {wall[t]:7.3f} s wall (runs: {each}), {cpu[t]:.3f} s CPU")
    pairs = [one / two for (one, _), (two, _) in zip(runs[1], runs[2])]
    gain = wall[1] / wall[2]
    ok = gain >= BAR
    print(f"  per pair (one / two): {', '.join(f'{g:.2f}' for g in pairs)}")
    mark = "PASS" if ok else "FAIL"
    print(f"  {'gain (one / two)':<28} {gain:10.3f} x   bar {BAR:10.3f} x   (at least) {mark}")
    if ok:
        print(f"  keep: two writers gain {gain:.2f}x, at least the {BAR}x bar")
    else:
        print(f"  drop: two writers gain {gain:.2f}x, less than the {BAR}x bar")
    print(f"  load average after: {os.getloadavg()[0]:.2f}")
    return ok
