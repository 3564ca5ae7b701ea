"""``plan --scheme``'s zero rows against DeepSpeed's real ZeRO engine, where it is
installed (it is not a dependency: ``pip install deepspeed``; the test is skipped
without it).

Two and four ranks over gloo (DeepSpeed's CPU accelerator) train a transformers
Llama (hidden 128, 4 layers) in bfloat16 with float32 master partitions, micro-batch
2 of 64 tokens, under ZeRO stages 1, 2 and 3; ``zero_ranks`` measures the third
step's peak storage bytes per rank. Bucket sizes are set small (the defaults'
5e8-element buckets would be nearly all of such a model's peak, and would prove
nothing about the rest), and the same settings go into the rows
(``plan_model(scheme_settings=...)``); each row must be within 3% of every rank's
peak.
"""

from __future__ import annotations

import pytest
from helpers import options

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")


from tests.fsdp2_ranks import CONFIGS, launch  # noqa: E402
from tests.zero_ranks import ZeroJob, rank_main  # noqa: E402
from yafsdp_cli.memory.step_schemes import SchemeSettings, ZeroConfig  # noqa: E402
from yafsdp_cli.planning import PlanOptions, plan_model  # noqa: E402
from yafsdp_cli.sources import load_source  # noqa: E402

pytestmark = pytest.mark.hf

MODEL, BATCH, SEQ = "llama-bench", 2, 64
ZERO = ZeroConfig(
    reduce_bucket_size=200_000,
    allgather_bucket_size=200_000,
    prefetch_bucket_size=50_000,
    param_persistence_threshold=1_000,
)
DEEPSPEED = {
    "reduce_bucket_size": ZERO.reduce_bucket_size,
    "allgather_bucket_size": ZERO.allgather_bucket_size,
    "stage3_prefetch_bucket_size": ZERO.prefetch_bucket_size,
    "stage3_param_persistence_threshold": ZERO.param_persistence_threshold,
}
STAGES = (1, 2, 3)
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The plan's peak per (stage, world size), with the engine's bucket sizes."""
    folder = tmp_path_factory.mktemp(MODEL)
    CONFIGS[MODEL]().save_pretrained(folder)
    loaded = load_source(folder)
    opts = options(PlanOptions,
        gpu_memory=2**40, reserve=0, world_sizes=(1, 2, 4), micro_batches=(1, BATCH),
        checkpointing=("none",), seq_len=SEQ, target="cpu", round_bytes=1,
        param_dtype="bfloat16", jobs=1, schemes=tuple(f"zero{s}" for s in STAGES),
    )  # fmt: skip
    report = plan_model(loaded, opts, scheme_settings=SchemeSettings(zero=ZERO))
    return {
        (int(s.scheme.name.removeprefix("zero")), r.world_size): r.peak_bytes
        for s in report.schemes
        if s.scheme.name != "flat"
        for r in s.rows
        if r.micro_batch == BATCH
    }


@pytest.mark.parametrize("world", (2, 4), ids=lambda n: f"ws{n}")
def test_every_ranks_zero_step_peak_is_the_row(world, planned, tmp_path_factory):
    jobs = [ZeroJob(stage, MODEL, BATCH, SEQ, DEEPSPEED) for stage in STAGES]
    held = launch(world, jobs, tmp_path_factory.mktemp(f"zero-{world}"), rank_main)
    assert [[stray for _, stray in peaks] for peaks in held] == [[0] * len(jobs)] * world
    ratios = {
        (job.stage, rank): planned[(job.stage, world)] / held[rank][j][0]
        for j, job in enumerate(jobs)
        for rank in range(world)
    }
    print(f"world size {world}: plan / real", {k: round(v, 4) for k, v in ratios.items()})
    for (stage, rank), ratio in ratios.items():
        assert abs(ratio - 1) <= TOLERANCE, (stage, world, rank, f"{ratio:.4f}")
