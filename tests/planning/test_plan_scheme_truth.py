"""``plan --scheme``'s fsdp2 and ddp rows against the real engines' steps, rank by rank.

On gloo at world sizes 2 and 4 (one launch each, ranks forked from the FSDP2
harness's forkserver: ``fsdp2_ranks.launch``), each rank trains a transformers Llama
(hidden 128, 4 layers, vocabulary 1000) with foreach AdamW in float32, micro-batch 2
of 64 tokens, under real ``fully_shard`` (``reshard_after_forward`` True and False)
and real ``DistributedDataParallel``; ``scheme_ranks`` measures the third step's peak
storage bytes with the profiler's tracker. The plan of the same model (its config
alone, built on meta; CPU kernels, no allocator rounding) must give every rank's
peak within 3%. The harness makes the real step's peak the same in every run
(``scheme_ranks.settled_collectives``); each rank reports how many of its storages
were freed off its main thread anyway, and that count must be 0.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import options

pytest.importorskip("transformers")


from tests.fsdp2_ranks import CONFIGS, launch  # noqa: E402
from tests.scheme_ranks import StepJob, rank_main  # noqa: E402
from yafsdp_cli.memory.step_schemes import SchemeSettings  # noqa: E402
from yafsdp_cli.planning import PlanOptions, plan_model  # noqa: E402
from yafsdp_cli.sources import load_source  # noqa: E402

pytestmark = pytest.mark.hf

MODEL, BATCH, SEQ = "llama-bench", 2, 64
JOBS = (
    StepJob("fsdp2", MODEL, BATCH, SEQ),
    StepJob("fsdp2", MODEL, BATCH, SEQ, reshard_after_forward=False),
    StepJob("ddp", MODEL, BATCH, SEQ),
)
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The plan's peak per (scheme, reshard_after_forward, world size)."""
    folder = tmp_path_factory.mktemp(MODEL)
    CONFIGS[MODEL]().save_pretrained(folder)
    loaded = load_source(folder)
    opts = options(
        PlanOptions,
        gpu_memory=2**40,
        reserve=0,
        world_sizes=(1, 2, 4),
        micro_batches=(1, BATCH),
        checkpointing=("none",),
        seq_len=SEQ,
        target="cpu",
        round_bytes=1,
        param_dtype="float32",
        jobs=1,
        schemes=("flat", "fsdp2", "ddp"),
    )
    out = {}
    for resharded in (True, False):
        settings = SchemeSettings(reshard_after_forward=resharded)
        for s in plan_model(loaded, opts, scheme_settings=settings).schemes:
            for r in s.rows:
                if r.micro_batch == BATCH and (resharded or s.scheme.name == "fsdp2"):
                    out[(s.scheme.name, resharded, r.world_size)] = r.peak_bytes
    return out


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"ws{n}")
def measured(request, tmp_path_factory):
    world = request.param
    return world, launch(world, list(JOBS), tmp_path_factory.mktemp(f"schemes-{world}"), rank_main)


def test_every_ranks_step_peak_is_the_schemes_row(measured, planned):
    world, held = measured
    ratios = {}
    assert [[p.stray_frees for p in peaks] for peaks in held] == [[0] * len(JOBS)] * world
    for j, job in enumerate(JOBS):
        row = planned[(job.scheme, job.reshard_after_forward, world)]
        for rank in range(world):
            ratios[(job.scheme, job.reshard_after_forward, rank)] = row / held[rank][j].peak
    print(f"world size {world}: plan / real", {k: round(v, 4) for k, v in ratios.items()})
    for (scheme, resharded, rank), ratio in ratios.items():
        assert abs(ratio - 1) <= TOLERANCE, (scheme, resharded, world, rank, f"{ratio:.4f}")


def test_the_flat_scheme_row_is_the_plans_own(planned, tmp_path_factory):
    """The schemes' flat column is the plan's grid, cell for cell."""
    folder = tmp_path_factory.mktemp("gpt2")
    CONFIGS["gpt2"]().save_pretrained(folder)
    loaded = load_source(folder)
    opts = options(PlanOptions,
        gpu_memory=2**40, world_sizes=(1, 2), micro_batches=(1, 2), seq_len=8, target="cpu",
        checkpointing=("none",), jobs=1, schemes=("flat", "fsdp2"),
    )  # fmt: skip
    report = plan_model(loaded, opts)
    flat = next(s for s in report.schemes if s.scheme.name == "flat")
    grid = {(r.world_size, r.micro_batch, r.checkpointing): r.peak_bytes for r in report.rows}
    assert {(r.world_size, r.micro_batch, r.checkpointing): r.peak_bytes for r in flat.rows} == grid
    plain = plan_model(loaded, dataclasses.replace(opts, schemes=("flat",)))
    assert plain.schemes == () and [r.peak_bytes for r in plain.rows] == list(grid.values())
