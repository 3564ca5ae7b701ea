"""The rank side of the FSDP2 truth harness (``test_fsdp2_truth.py``).

Each rank runs real ``fully_shard`` (every decoder block, then the root) on tiny
transformers models over gloo, takes one AdamW step and measures the storages it
holds: ``untyped_storage().nbytes()`` of the local tensors of parameters, gradients
and optimizer states. The harness starts ranks from a forkserver that has imported
this module (and so torch and transformers) once: a rank costs a fork, not an import.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from tests.hf_models import VOCAB, deepseek_v3_shape, tiny_config

# hidden 48: dims 1 of the fused experts (2 * 96, 48) and the router (48) divide by
# 2, 3 and 8, so a Shard(1) remedy exists at every world size of the harness
CONFIGS = {
    "llama": lambda: tiny_config("llama"),
    "gpt2": lambda: tiny_config("gpt2"),
    "mixtral": lambda: tiny_config("mixtral"),
    "qwen2": lambda: tf.Qwen2Config(  # tied, with q/k/v biases
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "mixtral48": lambda: tf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # larger ones for benchmarks/bench_fsdp2.py (docs/inspect.md's FSDP2 column)
    "llama-bench": lambda: tf.LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "mixtral-bench": lambda: tf.MixtralConfig(
        vocab_size=1000,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    # plan --scheme's truth (test_plan_scheme_truth.py): routed experts that split
    # unevenly (5 on 2 ranks: 3 and 2; on 4: 2, 2, 1, 0), eight layers, so the plan's
    # engine steps are one period traced and repeated
    "qwen3moe": lambda: tf.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=5,
        num_experts_per_tok=2,
    ),
    # multi-head latent attention, a shared and 5 routed experts, 2 dense layers first
    "deepseek3": lambda: deepseek_v3_shape(6, experts=5),
    # fused q/k/v and gate/up projections
    "phi3": lambda: tf.Phi3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    ),
}
MODEL_CLASSES = {
    "llama": tf.LlamaForCausalLM,
    "llama-bench": tf.LlamaForCausalLM,
    "gpt2": tf.GPT2LMHeadModel,
    "mixtral": tf.MixtralForCausalLM,
    "qwen2": tf.Qwen2ForCausalLM,
    "mixtral48": tf.MixtralForCausalLM,
    "mixtral-bench": tf.MixtralForCausalLM,
    "qwen3moe": tf.Qwen3MoeForCausalLM,
    "deepseek3": tf.DeepseekV3ForCausalLM,
    "phi3": tf.Phi3ForCausalLM,
}


@dataclass(frozen=True)
class Job:
    model: str  # a key of CONFIGS
    dtype: str  # "float32" or "bfloat16": the training dtype
    mixed: bool  # float32 shards under MixedPrecisionPolicy(param_dtype=bfloat16)
    placement_fn: str = ""  # the "shard_placement_fn=..." text inspect printed, or ""


@dataclass(frozen=True)
class Held:
    """Storage bytes one rank holds after one step."""

    params: int
    grads: int  # distinct storages: every gradient of a unit views one tensor
    optimizer: int  # exp_avg and exp_avg_sq
    step: int  # AdamW's step counters
    step_count: int
    step_on_host: bool


def build(name: str) -> torch.nn.Module:
    return MODEL_CLASSES[name](CONFIGS[name]())


def blocks(model: torch.nn.Module):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def placement_fn(text: str):
    """Evaluate inspect's recommendation exactly as printed."""
    if not text:
        return None
    assert text.startswith("shard_placement_fn="), text
    return eval(text.removeprefix("shard_placement_fn="), {"Shard": Shard})  # noqa: S307


def shard(model: torch.nn.Module, job: Job) -> None:
    kw = {"shard_placement_fn": placement_fn(job.placement_fn)}
    if job.mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    elif job.dtype == "bfloat16":
        model.to(torch.bfloat16)
    for block in blocks(model):
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if isinstance(t, DTensor) else t
    s = local.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Held:
    params = list(model.parameters())
    grads = {_storage(p.grad) for p in params if p.grad is not None}
    states = [(k, v) for p in params for k, v in opt.state[p].items()]
    steps = [v for k, v in states if k == "step"]
    return Held(
        params=sum(_storage(p)[1] for p in params),
        grads=sum(nbytes for _, nbytes in grads),
        optimizer=sum(_storage(v)[1] for k, v in states if k != "step"),
        step=sum(_storage(v)[1] for v in steps),
        step_count=len(steps),
        step_on_host=all(v.device.type == "cpu" and v.dim() == 0 for v in steps),
    )


def run_job(job: Job) -> Held:
    torch.manual_seed(0)
    model = build(job.model)
    shard(model, job)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return measure(model, opt)


def serve_rank(rank: int, world: int, tmp: str, jobs: list, run) -> None:
    """One gloo rank of a launch: ``run(job)`` for every job, the results pickled to
    ``rank{rank}.pkl`` (written under another name first, so a reader never sees half
    a file), then a barrier so no rank leaves while another still runs."""
    torch.set_num_threads(1)
    tf.logging.set_verbosity_error()  # "loss_type=None ... unrecognized", once per rank
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=3),
    )
    try:
        results = [run(job) for job in jobs]
        part = Path(tmp) / f"rank{rank}.part"
        part.write_bytes(pickle.dumps(results))
        part.rename(Path(tmp) / f"rank{rank}.pkl")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def worker(rank: int, world: int, tmp: str, jobs: list[Job]) -> None:
    serve_rank(rank, world, tmp, jobs, run_job)


def launch(world: int, jobs: list, tmp: Path, rank_main=worker) -> list[list]:
    """Every job on ``world`` ranks, in one launch: ``[rank][job]``. ``rank_main``
    (a module-level function taking ``(rank, world, tmp, jobs)`` and writing
    ``rank{rank}.pkl``) runs on each rank; ``worker`` by default."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload([__name__])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        rank_main, args=(world, str(tmp), jobs), nprocs=world, join=True, start_method="forkserver"
    )
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(world)]
