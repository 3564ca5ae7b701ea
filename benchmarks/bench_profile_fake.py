"""Bar: ``profile --fake`` of Llama-2-70B (batch 1, 4096 tokens, AdamW) at world size
256, forward + backward + optimizer step of the original *and* of the converted
model: under 30 s and under 1 GB peak RSS on 2 CPU cores.

The model is transformers' ``LlamaForCausalLM`` built from the ``config.json`` that
``meta-llama/Llama-2-70b-hf`` ships (written below; a config-only folder is built on
the meta device, so no weights are needed), with its default attention (``sdpa``).
Run once per target: the CPU kernels, and ``--target cuda`` (CUDA's attention
kernels, 512-byte allocator rounding, foreach AdamW).

python -m benchmarks.run profile_fake
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path

from benchmarks.common import YAFSDP, MiB, measure, verdict

WALL_BAR_S = 30.0
RSS_BAR_BYTES = 1024 * MiB  # "1 GB" read as 1 GiB would be looser; we use 1024 MiB

# meta-llama/Llama-2-70b-hf config.json (the fields transformers reads)
LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 4096,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 32000,
}


def write_config(folder: Path, config: dict = LLAMA2_70B) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def argv(folder: Path, target: str) -> list[str]:
    return [
        YAFSDP,
        "profile",
        str(folder),
        "--fake",
        "--target",
        target,
        "--world-size",
        "256",
        "--batch",
        "1",
        "--seq-len",
        "4096",
        "--optimizer",
        "adamw",
        "--json",
    ]


def report(doc: dict) -> None:
    gib = 1024**3
    for variant in ("original", "converted"):
        step = doc[variant]
        peak = step["peak"]
        parts = ", ".join(f"{k} {peak[k] / gib:.2f}" for k in peak)
        print(
            f"  {variant:<9} peak {step['peak_bytes'] / gib:8.2f} GiB ({step['peak_phase']}): "
            f"{parts} GiB; {step['ops']} ops, {step['wall_s']:.1f} s"
        )
    if doc.get("kernels"):
        print(f"  attention kernels: {doc['kernels']}")


def _children_cpu_s() -> float:
    """CPU seconds of waited-for child processes: the wall time on a busy machine
    overstates what the command costs; this does not (a fake step runs no kernels)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_config(Path(tmp) / "llama-2-70b")
        for target in ("cpu", "cuda"):
            print(f" --target {target} (load average {os.getloadavg()[0]:.1f})")
            before = _children_cpu_s()
            run = measure(argv(folder, target))
            print(f"  CPU time (user + system)     {_children_cpu_s() - before:10.3f} s")
            if run.returncode != 0:
                print(f"  profile --fake failed with exit {run.returncode}")
                ok = False
                continue
            report(json.loads(run.stdout))
            ok &= verdict("wall time", run.wall_s, WALL_BAR_S, "s")
            ok &= verdict("peak RSS", run.peak_rss_bytes / MiB, RSS_BAR_BYTES / MiB, "MiB")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
