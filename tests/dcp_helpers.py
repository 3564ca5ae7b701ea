"""Real FSDP2 ranks for the DCP tests: train a tiny Hugging Face Llama under
``fully_shard`` on gloo and save it with ``dcp.save``, or load a DCP folder into a
fresh ``fully_shard`` model; each run gathers the full state dict on rank 0.

Ranks are forked from a forkserver that imported torch and transformers once, so a
launch costs a fork, not an interpreter start (a spawn per rank takes several
seconds on a 2-core machine). Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
from hf_models import VOCAB, tiny_config

STEPS = 3
PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers"]


def tiny_llama():
    """A tiny Llama with the embedding tied to the head (the factory for ``--model``)."""
    import transformers as tf

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    return tf.LlamaForCausalLM(cfg)


def launch(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, store, *args)`` on ``world`` gloo ranks."""
    import torch.multiprocessing as mp

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            fn,
            args=(world, str(Path(tmp) / "store"), *args),
            nprocs=world,
            start_method="forkserver",
        )


def _init(rank: int, world: int, store: str):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def train_and_save(rank: int, world: int, store: str, out: str) -> None:
    """A few AdamW steps, then two DCP saves of the same state: torchtitan's nested
    ``{"model", "optimizer", "train_state"}`` and newer torchtitan's model keys at the
    top level; rank 0 writes the gathered full state dict as the reference."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = _init(rank, world, store)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, (2, 8), generator=gen)  # (B, T), one batch per rank
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    nested = {"model": msd, "optimizer": osd, "train_state": {"step": STEPS}}
    dcp.save(nested, checkpoint_id=f"{out}/nested")
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=f"{out}/top")
    full = _full_state(model)
    if rank == 0:
        torch.save(full, f"{out}/reference.pt")
    dist.destroy_process_group()


def load_and_gather(rank: int, world: int, store: str, ckpt: str, out: str) -> None:
    """Load DCP folder ``ckpt`` into a freshly initialised (other seed) ``fully_shard``
    model on ``world`` ranks, the way FSDP2 recipes resume; rank 0 saves what the
    model then holds, gathered."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(1234)
    model = _init(rank, world, store)
    state = get_model_state_dict(model)  # DTensor shards of this rank
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state)
    full = _full_state(model)
    if rank == 0:
        torch.save(full, out)
    dist.destroy_process_group()
