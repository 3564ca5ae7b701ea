"""The rank side of the ZeRO truth harness (``test_plan_zero_truth.py``).

Each rank trains a tiny transformers model for three steps under DeepSpeed's real
ZeRO engine (stage 1, 2 or 3, bfloat16 with float32 master partitions, torch's
foreach AdamW as the client optimizer) over gloo with DeepSpeed's CPU accelerator,
and measures the third step with the profiler's tracker. Every tensor alive before
that step (DeepSpeed's flat parameter groups, partitions, optimizer states) is
registered first, found through the garbage collector, so the peak counts all the
rank holds.

As in ``scheme_ranks``, the collectives get private copies (``_settled_zero``), so
no storage of the step is freed by gloo's thread at a moment of its choosing, and
each rank reports how many were freed off its main thread anyway (0 expected).

DeepSpeed's CPU communication starts by compiling a shared-memory all-reduce op, a
C++ build of minutes; without it DeepSpeed's collectives go through
``torch.distributed``, which is what the test wants, so the harness skips the build.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from dataclasses import dataclass

import torch

from tests.fsdp2_ranks import build, serve_rank
from tests.scheme_ranks import (
    LocalStorages,
    private_copies,
    private_in_place,
    settled_collectives,
)


@dataclass(frozen=True)
class ZeroJob:
    stage: int
    model: str  # a key of fsdp2_ranks.CONFIGS
    batch: int
    seq_len: int
    zero: dict  # DeepSpeed's zero_optimization settings beside the stage


def _engine(job: ZeroJob):
    import deepspeed

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    torch.manual_seed(0)
    model = build(job.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    config = {
        "train_micro_batch_size_per_gpu": job.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": job.stage, **job.zero},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _alive_tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not o.is_meta]


def _step(engine, ids: torch.Tensor, tracker: LocalStorages | None = None) -> None:
    phase = tracker.set_phase if tracker is not None else (lambda _name: None)
    phase("forward")
    loss = engine(input_ids=ids, labels=ids).loss
    phase("backward")
    engine.backward(loss)
    del loss
    phase("optimizer")
    engine.step()


# What ZeRO calls on ``torch.distributed`` at every call, and the all-gather and
# reduce-scatter that DeepSpeed's communication backend keeps references to (ZeRO-3
# fetches parameters through them).
ZERO_COLLECTIVES = {
    "all_gather_into_tensor": private_copies,
    "reduce_scatter_tensor": private_copies,
    "all_reduce": private_in_place,
    "broadcast": private_in_place,
}
BACKEND_COLLECTIVES = {
    "all_gather_function": private_copies,
    "reduce_scatter_function": private_copies,
}


@contextlib.contextmanager
def _settled_zero():
    """``scheme_ranks.settled_collectives`` for DeepSpeed's collectives."""
    from deepspeed.comm import comm

    with settled_collectives(ZERO_COLLECTIVES), settled_collectives(BACKEND_COLLECTIVES, comm.cdb):
        yield


def run_zero_step(job: ZeroJob) -> tuple[int, int]:
    """The third step's peak bytes on this rank, and how many of the storages it
    tracked were freed off the rank's main thread (``scheme_ranks``: 0 expected)."""
    engine = _engine(job)
    vocab = engine.module.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (job.batch, job.seq_len), generator=gen)
    for _ in range(2):
        _step(engine, ids)
    gc.collect()
    tracker = LocalStorages(1)
    tracker.assign(_alive_tensors(), "parameters")
    with _settled_zero(), tracker:
        _step(engine, ids, tracker)
    peak = tracker.replay().peak.total
    engine.destroy()
    return peak, tracker.stray_frees


def rank_main(rank: int, world: int, tmp: str, jobs: list[ZeroJob]) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    serve_rank(rank, world, tmp, jobs, run_zero_step)
