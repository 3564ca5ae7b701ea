"""The rank side of ``tests/engine/test_accumulation.py`` (a module of its own so that
the forkserver can import it).

Each rank trains the sample GPT (tied ``wte``/``lm_head``) converted and sharded
(``ShardedFlat`` over ``DistComm``), ``steps`` steps of ``micro`` accumulated
micro-batches, and compares, after each step's micro-batches, every gradient by name
(tied names too, gathered from the shards) and, after the optimizer step, every
parameter with the reference: the original whole model over every rank's
micro-batches in one process, each micro-batch's gradients summed in rank order and
those sums accumulated (``verify.dist.reference_step``, the order ``DistComm``
sums in). Between steps the gradients are zeroed by the door ``case.door`` names.
"""

from __future__ import annotations

import copy
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import build, options

from yafsdp_cli import convert_module, plan, spec_from_module
from yafsdp_cli.engine.sharded import DistComm, ShardedFlat
from yafsdp_cli.engine.train_step import forward_backward, make_optimizer
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.verify.dist import reference_step
from yafsdp_cli.verify.harness import VerifyOptions, batch_for, micro_seed, named_params
from yafsdp_cli.verify.numerics import pinned


@dataclass(frozen=True)
class Case:
    door: str  # "optimizer", "optimizer-zeros" (set_to_none=False) or "sharded"
    micro: int = 4
    steps: int = 3
    world: int = 2
    filters: tuple[str, ...] = ("linear", "embedding")  # the norms stay unconverted


def rank_main(rank: int, world: int, tmp: str, case: Case) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        with pinned(1):
            result = train(rank, case)
        part = Path(tmp) / f"rank{rank}.part"
        part.write_bytes(pickle.dumps(result))
        part.rename(Path(tmp) / f"rank{rank}.pkl")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(rank: int, case: Case) -> list[dict[str, list[str]]]:
    """Per step, the names whose gradient or parameter differs from the reference's."""
    opts = options(VerifyOptions, world_size=case.world, micro_batches=case.micro)
    model = build("gpt")
    twin = copy.deepcopy(model)
    layout = plan(
        spec_from_module(twin), LayoutOptions(world_size=case.world, filters=case.filters)
    )
    sharded = ShardedFlat(convert_module(twin, layout), DistComm())
    assert sharded.kept_parameters(), "the case must keep some parameters unconverted"
    opt = make_optimizer("sgd", sharded.parameters())
    ref_opt = make_optimizer("sgd", model.parameters())
    out = []
    for step in range(case.steps):
        ref, _ = reference_step(model, model, opts, step, rank, case.world)
        for m in range(case.micro):
            seed = micro_seed(opts, step, m, rank)
            forward_backward(twin, batch_for(model, opts, seed), seed)
            sharded.finish_backward()
        sharded.before_step()
        grads = sharded.gathered_named("grad")
        for n, p in model.named_parameters(remove_duplicate=False):
            p.grad = ref[n]
        ref_opt.step()
        model.zero_grad(set_to_none=True)
        opt.step()
        params = sharded.gathered_named("param")
        out.append(
            {
                "grads": [n for n, g in ref.items() if not _same(grads[n], g)],
                "params": [n for n, p in named_params(model).items() if not _same(params[n], p)],
            }
        )
        _zero(case.door, opt, sharded)
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


def _zero(door: str, opt, sharded: ShardedFlat) -> None:
    if door == "sharded":
        sharded.zero_grad()
    else:
        opt.zero_grad(set_to_none=door == "optimizer")


def launch(case: Case, tmp: Path) -> list:
    """``case`` on ``case.world`` new processes; per rank, ``train``'s result."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload([__name__])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        rank_main, args=(case.world, str(tmp), case), nprocs=case.world, join=True,
        start_method="forkserver",
    )  # fmt: skip
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(case.world)]
