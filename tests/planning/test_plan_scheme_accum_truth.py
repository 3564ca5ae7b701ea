"""``plan --scheme --grad-accum N``'s fsdp2 and ddp figures against the real engines'
steps of N micro-batches, rank by rank (the harness of ``test_plan_scheme_truth.py``:
real ``fully_shard`` and ``DistributedDataParallel`` on gloo, the measured step's
storages tracked). FSDP2 with gradient sync on in every micro-batch (its rows) and
off until the last (``no_sync_peak_bytes``, at the best configuration), DDP under
``no_sync()`` until the last (its rows): every rank's peak within the same 3%."""

from __future__ import annotations

import pytest
from helpers import options

pytest.importorskip("transformers")


from tests.fsdp2_ranks import CONFIGS, launch  # noqa: E402
from tests.scheme_ranks import StepJob, rank_main  # noqa: E402
from yafsdp_cli.planning import PlanOptions, plan_model  # noqa: E402
from yafsdp_cli.sources import load_source  # noqa: E402

pytestmark = pytest.mark.hf

MODEL, BATCH, SEQ, ACCUM = "llama-bench", 2, 64, 3
JOBS = {
    ("fsdp2", True): StepJob("fsdp2", MODEL, BATCH, SEQ, grad_accum=ACCUM),
    ("fsdp2", False): StepJob("fsdp2", MODEL, BATCH, SEQ, grad_accum=ACCUM, sync=False),
    ("ddp", False): StepJob("ddp", MODEL, BATCH, SEQ, grad_accum=ACCUM, sync=False),
}
TOLERANCE = 0.03


def planned(folder, world: int) -> dict:
    """The plan's peak per (scheme, sync) at ``world`` ranks, micro-batch ``BATCH``."""
    opts = options(PlanOptions,
        gpu_memory=2**40, reserve=0, world_sizes=(world,), micro_batches=(BATCH,),
        checkpointing=("none",), seq_len=SEQ, target="cpu", param_dtype="float32",
        grad_accum=ACCUM, jobs=1, schemes=("fsdp2", "ddp"),
    )  # fmt: skip
    schemes = {s.scheme.name: s for s in plan_model(load_source(folder), opts).schemes}
    fsdp2, ddp = schemes["fsdp2"], schemes["ddp"]
    return {
        ("fsdp2", True): fsdp2.best.peak_bytes,
        ("fsdp2", False): fsdp2.no_sync_peak_bytes,
        ("ddp", False): ddp.best.peak_bytes,
    }


@pytest.mark.parametrize("world", (2, 4), ids=lambda n: f"ws{n}")
def test_every_ranks_peak_of_n_micro_batches_is_the_schemes(world, tmp_path_factory):
    folder = tmp_path_factory.mktemp(MODEL)
    CONFIGS[MODEL]().save_pretrained(folder)
    plan = planned(folder, world)
    assert plan[("fsdp2", False)] > plan[("fsdp2", True)]  # whole gradients held
    held = launch(world, list(JOBS.values()), tmp_path_factory.mktemp(f"accum-{world}"), rank_main)
    assert [[p.stray_frees for p in peaks] for peaks in held] == [[0] * len(JOBS)] * world
    ratios = {
        (key, rank): plan[key] / held[rank][j].peak
        for j, key in enumerate(JOBS)
        for rank in range(world)
    }
    print(f"world size {world}: plan / real", {k: round(v, 4) for k, v in ratios.items()})
    for (key, rank), ratio in ratios.items():
        assert abs(ratio - 1) <= TOLERANCE, (key, world, rank, f"{ratio:.4f}")
