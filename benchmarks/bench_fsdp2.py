"""The ``fsdp`` column of ``inspect`` against real FSDP2, every rank (docs/inspect.md).

Bar: the memory model's per-rank persistent bytes equal what real
FSDP2 holds within 1%, every rank. Real ``fully_shard`` on every decoder block and
the root, gloo on the CPU, one AdamW step, on a dense Llama (4 blocks, hidden 128)
and a Mixtral with 4 fused experts (4 blocks, hidden 128), float32, at 3 and 8
ranks, and the Mixtral again with the ``shard_placement_fn`` inspect recommends.
Figures are parameters + gradients + AdamW ``exp_avg``/``exp_avg_sq`` storage bytes
(``untyped_storage().nbytes()``; ``--round-bytes 1``, since CPU storages are not
rounded; the 4-byte ``step`` counters are left out, as the model states).

python -m benchmarks.run fsdp2
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from .common import DATA, ROOT

RUNS = ((3, ("llama-bench", "mixtral-bench")), (8, ("llama-bench", "mixtral-bench")))


def _inspect(folder: Path, world: int, placement: str):
    from yafsdp_cli.inspection.build import inspect_model
    from yafsdp_cli.sources import load_source

    report = inspect_model(
        load_source(folder), world_size=world, round_bytes=1, fsdp_placement=placement
    )
    return {s.scheme: s for s in report.memory.schemes}, report.memory.fsdp_uneven


def _held(groups) -> list[int]:
    return [
        g.params + g.grads + g.optimizer for g in groups for _ in range(g.ranks[1] - g.ranks[0] + 1)
    ]


def _rows(world: int, models: tuple[str, ...]) -> list[tuple]:
    from tests.fsdp2_ranks import CONFIGS, Job, launch

    jobs, folders = [], {}
    for name in models:
        folders[name] = DATA / f"fsdp2-{name}"
        CONFIGS[name]().save_pretrained(folders[name])
        jobs.append(Job(name, "float32", mixed=False))
        uneven = _inspect(folders[name], world, "dim0")[1]
        if uneven and uneven.shard_placement_fn:
            jobs.append(dataclasses.replace(jobs[-1], placement_fn=uneven.shard_placement_fn))
    with tempfile.TemporaryDirectory() as tmp:
        held = launch(world, jobs, Path(tmp))
    rows = []
    for j, job in enumerate(jobs):
        schemes, _ = _inspect(folders[job.model], world, "auto" if job.placement_fn else "dim0")
        modeled = _held(schemes["fsdp"].ranks)
        measured = [h.params + h.grads + h.optimizer for h in (r[j] for r in held)]
        flat = schemes["yafsdp"]
        worst = max(abs(m - h) / h for m, h in zip(modeled, measured))
        placement = "Shard(1) fn" if job.placement_fn else "Shard(0)"
        rows.append(
            (
                job.model,
                world,
                placement,
                max(modeled),
                max(measured),
                min(measured),
                flat.params + flat.grads + flat.optimizer + flat.master,
                worst,
            )
        )
    return rows


def main() -> bool:
    import sys

    sys.path.insert(0, str(ROOT))
    DATA.mkdir(parents=True, exist_ok=True)
    rows = [row for world, models in RUNS for row in _rows(world, models)]
    headers = ("model", "ranks", "placement", "inspect fsdp (fullest)", "FSDP2 fullest")
    headers += ("FSDP2 emptiest", "yafsdp flat", "worst rank off by")
    print("| " + " | ".join(headers) + " |")
    print("|---" * len(headers) + "|")
    for model, world, placement, *figures, worst in rows:
        cells = [model, str(world), placement, *(f"{f:,}" for f in figures), f"{100 * worst:.2f}%"]
        print("| " + " | ".join(cells) + " |")
    ok = all(row[-1] <= 0.01 for row in rows)
    print(f"  every rank within 1% of real FSDP2: {'PASS' if ok else 'FAIL'}")
    return ok
