"""Bar: the reserved peak ``plan`` carries to a cell without a fake run of its own
is at most 10% under a direct replay of that cell's own fake step (under is the side
that fails on a GPU; over wastes memory), and 5% off on average, on three Llama shapes
(2 layers of hidden 2048 at 512 tokens, 4 of 1024 at 1024, 6 of 768 at 2048; world
sizes 1, 2, 4, 8; micro-batches 1, 2, 4, 8; checkpointing none and non-reentrant;
CUDA's kernels, bf16 with float32 masters, AdamW foreach). Its worst figures are the
ones ``planning/reserved_fit.py`` states. CPU only: the replay is the allocator's
model (``memory.caching_allocator``), checked against GPUs by ``bench_reserved_cuda``.

python -m benchmarks.run plan_reserved
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

UNDER_BAR = 0.10
MEAN_BAR = 0.05
SHAPES = ((2048, 2, 512), (1024, 4, 1024), (768, 6, 2048))  # (hidden, layers, tokens)


def write_shape(folder: Path, hidden: int, layers: int, tokens: int) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=tokens,
    ).save_pretrained(folder)
    return folder


def carried_errors(folder: Path, tokens: int) -> list[float]:
    """(carried - direct) / direct for every cell the plan carries."""
    from yafsdp_cli.memory import reserved_of
    from yafsdp_cli.options import LayoutOptions, MemoryOptions
    from yafsdp_cli.planning import PlanOptions, plan_model
    from yafsdp_cli.planning.plan_options import PLAN_MEMORY, PLAN_STEP
    from yafsdp_cli.profiling import ProfileOptions
    from yafsdp_cli.profiling.profiler import profile_converted
    from yafsdp_cli.sources import load_source

    loaded = load_source(folder)
    opts = PlanOptions(
        step=dataclasses.replace(PLAN_STEP, seq_len=tokens),
        memory=dataclasses.replace(
            PLAN_MEMORY, gpu_memory=1 << 40, reserve=0, margin=0, alloc_conf=""
        ),
        world_sizes=(1, 2, 4, 8),
        micro_batches=(1, 2, 4, 8),
        jobs=1,
    )
    errors = []
    for row in plan_model(loaded, opts).rows:
        if row.reserved_replayed:
            continue
        traces: dict = {}
        step = ProfileOptions(
            layout=LayoutOptions(world_size=row.world_size),
            step=dataclasses.replace(
                opts.step, batch=row.micro_batch, checkpointing=row.checkpointing
            ),
            memory=MemoryOptions(round_bytes=opts.memory.round_bytes),
            fake=True,
        )
        profile_converted(loaded, step, traces=traces)
        direct = reserved_of(traces["converted"], "").reserved_peak
        errors.append((row.reserved_bytes - direct) / direct)
    return errors


def main() -> bool:
    errors_all: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden, layers, tokens in SHAPES:
            folder = write_shape(Path(tmp) / f"llama-{hidden}-{layers}", hidden, layers, tokens)
            errors = carried_errors(folder, tokens)
            mean = sum(map(abs, errors)) / len(errors)
            print(
                f"  Llama {layers} layers x {hidden}, {tokens} tokens: {len(errors)} carried "
                f"cells, {100 * min(errors):+.2f}% to {100 * max(errors):+.2f}% of their own "
                f"replay, mean |error| {100 * mean:.2f}%"
            )
            errors_all += errors
    under = -min(min(errors_all), 0.0)
    mean = sum(map(abs, errors_all)) / len(errors_all)
    ok = under <= UNDER_BAR and mean <= MEAN_BAR
    print(
        f"  worst under {100 * under:.2f}% (bar {100 * UNDER_BAR:.0f}%), worst over "
        f"{100 * max(errors_all):.2f}%, mean |error| {100 * mean:.2f}% (bar "
        f"{100 * MEAN_BAR:.0f}%): {'met' if ok else 'missed'}"
    )
    return ok
