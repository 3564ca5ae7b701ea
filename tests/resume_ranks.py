"""The rank side of ``test_resume_ranks.py``, and the one-process reference.

A leg of a run is a few steps of data-parallel AdamW on real gloo ranks: each rank
converts the sample GPT (three flat buffers: the root's and one per block), keeps its
shards (``ShardedFlat`` over ``DistComm``), loads its part of a checkpoint
(``sharded_adamw``), trains on its rows of each step's global batch and saves its
rank file (``save_sharded_training``).

The reference is the same schedule in one process with no checkpoint: per step, the
global batch split into the rows each of that step's ranks takes, one
forward/backward per sub-batch on the whole flat buffers, the sub-batches' flat
gradients summed in rank order (the left fold ``DistComm`` takes), then AdamW over
the whole buffers. Sharding, saving, resharding and loading must lose nothing for
the ranks to match it bit for bit.

A mixed-precision leg (``masters``) runs the GPT in bfloat16 with float32 masters
(``sharded_adamw(masters=True)``); its reference steps the masters of the whole
buffers (``flat_adamw(masters=True)``).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sample_models.models import gpt
from yafsdp_cli import CheckpointError, convert_module, plan, spec_from_module
from yafsdp_cli.checkpoint import open_flat
from yafsdp_cli.checkpoint.flat_training import ADAM_STATES, MASTER, flat_adamw, stepped
from yafsdp_cli.checkpoint.optim_state import SEP
from yafsdp_cli.checkpoint.sharded_training import save_sharded_training, sharded_adamw
from yafsdp_cli.engine.sharded import DistComm, ShardedFlat, fold
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.verify.numerics import apply, pinned

GLOBAL_BATCH = 12  # rows per step: divisible by 4, 3, 2 and 1 ranks
SEQ = 16  # tokens per row
VOCAB = 256  # the sample GPT's
HYPER = {"lr": 1e-2, "weight_decay": 0.1, "foreach": False}  # for-loop: as verify steps


@dataclass(frozen=True)
class Leg:
    """Steps ``first .. first + steps - 1`` on ``world`` ranks, from ``ckpt`` (None:
    the seeded model), saved to ``out``."""

    world: int
    first: int
    steps: int
    ckpt: str | None
    out: str
    masters: bool = False  # bfloat16 weights, float32 masters


def rows(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of step ``step``'s global batch: inputs and targets."""
    ids = torch.randint(
        0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step)
    )
    n = GLOBAL_BATCH // world
    mine = ids[rank * n : (rank + 1) * n]  # (n, SEQ + 1)
    return mine[:, :-1], mine[:, 1:]


def loss_of(model: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    """This sub-batch's share of the global batch's mean token loss (so the ranks'
    summed gradients are the global batch's)."""
    x, y = rows(step, rank, world)
    logits = model(x)  # (n, SEQ, VOCAB)
    total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    return total / (GLOBAL_BATCH * SEQ)


def seeded_model(masters: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt().to(torch.bfloat16) if masters else gpt()


# ---------------------------------------------------------------- one rank


def run_leg(rank: int, leg: Leg) -> list[torch.Tensor]:
    """This rank's part of ``leg``; its loss at every step."""
    model = seeded_model(leg.masters)
    if leg.ckpt is None:
        layout = plan(spec_from_module(model), LayoutOptions(world_size=leg.world))
    else:
        layout = open_flat(leg.ckpt).layout
    sharded = ShardedFlat(convert_module(model, layout), DistComm())
    opt = sharded_adamw(sharded, leg.ckpt, masters=leg.masters, **HYPER)
    losses = []
    for step in range(leg.first, leg.first + leg.steps):
        loss = loss_of(model, step, rank, leg.world)
        loss.backward()
        sharded.finish_backward()
        sharded.before_step()
        opt.step()
        sharded.zero_grad()
        losses.append(loss.detach())
    save_sharded_training(sharded, opt, leg.out)
    return losses


def rank_main(rank: int, world: int, tmp: str, leg: Leg) -> None:
    apply(1)  # one thread, as the reference: LayerNorm's backward sums per thread
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=2),
    )
    try:
        try:
            result = run_leg(rank, leg)
        except CheckpointError as exc:  # every rank raises it: the tests read it
            result = str(exc)
        part = Path(tmp) / f"rank{rank}.part"
        part.write_bytes(pickle.dumps(result))
        part.rename(Path(tmp) / f"rank{rank}.pkl")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(leg: Leg, tmp: Path) -> list:
    """``leg`` on ``leg.world`` new processes; per rank, its losses (one per step) or
    the ``CheckpointError`` it raised, as text."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload([__name__])  # a rank costs a fork, not an import
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        rank_main,
        args=(leg.world, str(tmp), leg),
        nprocs=leg.world,
        join=True,
        start_method="forkserver",
    )
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(leg.world)]


# ---------------------------------------------------------------- the reference


@dataclass
class Reference:
    losses: list[list[torch.Tensor]]  # [step][rank]
    saved: dict[int, dict[str, torch.Tensor]]  # after step -> stored name -> whole buffer
    steps: dict[int, torch.Tensor]  # after step -> AdamW's step count


def reference(worlds: list[int], save_after: tuple[int, ...], masters=False) -> Reference:
    """Step ``s`` on ``worlds[s]`` sub-batches, in one process (module docstring);
    the buffers and AdamW state after each step in ``save_after``."""
    with pinned(1):
        model = seeded_model(masters)
        flat = convert_module(
            model, plan(spec_from_module(model), LayoutOptions(world_size=worlds[0]))
        )
        opt = flat_adamw(flat, masters=masters, **HYPER)
        ref = Reference([], {}, {})
        for step, world in enumerate(worlds):
            ref.losses.append(_reference_step(model, flat, opt, step, world))
            if step in save_after:
                ref.saved[step] = _stored(flat, opt)
                ref.steps[step] = opt.state[stepped(opt, flat.buffers[0].param)]["step"].clone()
        return ref


def _reference_step(model, flat, opt, step: int, world: int) -> list[torch.Tensor]:
    losses, grads = [], []
    for r in range(world):
        loss = loss_of(model, step, r, world)
        loss.backward()
        losses.append(loss.detach())
        grads.append([b.param.grad.clone() for b in flat.buffers])
        opt.zero_grad()  # the next sub-batch's gradient starts from nothing
    for i, b in enumerate(flat.buffers):
        b.param.grad = fold(torch.stack([g[i] for g in grads]))  # rank order, left to right
    opt.step()
    opt.zero_grad()
    return losses


def _stored(flat, opt) -> dict[str, torch.Tensor]:
    out = {}
    for b in flat.buffers:
        master = stepped(opt, b.param)
        out[b.layout.name] = b.param.detach().clone()
        for f in ADAM_STATES:
            out[f"{b.layout.name}{SEP}{f}"] = opt.state[master][f].clone()
        if master is not b.param:
            out[f"{b.layout.name}{SEP}{MASTER}"] = master.clone()
    return out
