"""Bar: the Llama-3-8B grid at 8192 tokens on H100s agrees with itself. Every cell
of ``plan --gpu h100-sxm`` over the default grid (world sizes 1..512, micro-batches
1,2,4,8, checkpointing none and non-reentrant) equals the same cell planned alone
(world size, micro-batch and checkpointing given one each), and the grid under
``--objective gpu-hours`` equals it; every pair of neighbouring cells that is not
monotone (less memory for a larger micro-batch, more for more GPUs) has a note that
names what moved. The pairs are listed.

The plans run in this process (``plan_model``), one core: 80 single-cell plans.

python -m benchmarks.run plan_cells
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from benchmarks.bench_plan import LLAMA3_8B
from benchmarks.bench_profile_fake import write_config

SEQ = 8192
GIB = 1024**3


def figures(row) -> tuple:
    return (row.peak_bytes, row.reserved_bytes, row.needed_bytes, row.fits, row.breakdown)


def main() -> bool:
    from yafsdp_cli.planning import PlanOptions, plan_model
    from yafsdp_cli.planning.plan_options import PLAN_STEP
    from yafsdp_cli.sources import load_source

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_source(str(write_config(Path(tmp) / "Meta-Llama-3-8B", LLAMA3_8B)))
        step = dataclasses.replace(PLAN_STEP, seq_len=SEQ)
        base = PlanOptions(gpu="h100-sxm", step=step, jobs=1)
        start = time.perf_counter()
        grid = plan_model(loaded, base)
        hours = plan_model(
            loaded, dataclasses.replace(base, objective="gpu-hours", tokens=2 * 10**12)
        )
        print(f"  grid: {len(grid.rows)} cells in {time.perf_counter() - start:.1f} s (two plans)")
        differ = [r.cell for r, h in zip(grid.rows, hours.rows) if figures(r) != figures(h)]
        start, alone_differ = time.perf_counter(), []
        for row in grid.rows:
            one = dataclasses.replace(
                base,
                world_sizes=(row.world_size,),
                micro_batches=(row.micro_batch,),
                checkpointing=(row.checkpointing,),
            )
            (alone,) = plan_model(loaded, one).rows
            if figures(alone) != figures(row):
                alone_differ.append((row, alone))
    print(f"  {len(grid.rows)} cells planned alone in {time.perf_counter() - start:.1f} s")
    for row, alone in alone_differ:
        print(
            f"  differs alone: {row.world_size} x {row.micro_batch} {row.checkpointing}: "
            f"{row.needed_bytes / GIB:.2f} GiB in the grid, {alone.needed_bytes / GIB:.2f} alone"
        )
    notes = [n for n in grid.notes if n.startswith("not monotone")]
    pairs = _not_monotone(grid.rows)
    for note in notes:
        print(f"  {note}")
    print(
        f"  cells that differ alone: {len(alone_differ)}; under --objective gpu-hours: "
        f"{len(differ)}; pairs not monotone: {pairs}, with a note: {len(notes)}"
    )
    ok = not alone_differ and not differ and pairs == len(notes)
    print(f"  self-consistent: {'PASS' if ok else 'FAIL'}")
    return ok


def _not_monotone(rows) -> int:
    at = {(r.world_size, r.micro_batch, r.checkpointing): r for r in rows}
    sizes = sorted({r.world_size for r in rows})
    mbs = sorted({r.micro_batch for r in rows})
    count = 0
    for (ws, mb, ck), r in at.items():
        if mb != mbs[0]:
            prev = at[(ws, mbs[mbs.index(mb) - 1], ck)]
            count += r.needed_bytes < prev.needed_bytes
        if ws != sizes[0]:
            prev = at[(sizes[sizes.index(ws) - 1], mb, ck)]
            count += r.needed_bytes > prev.needed_bytes
    return count


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
