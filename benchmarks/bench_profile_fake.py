"""Bar: ``profile --fake`` of a Llama-2-70B config (batch 1, 4096 tokens, AdamW) at
world size 256, forward + backward + optimizer step of the original *and* of the
converted model: under 30 s and under 1 GB peak RSS on this 2-core machine.

python -m benchmarks.run profile_fake
"""

from __future__ import annotations

import json

from benchmarks.common import YAFSDP, MiB, measure, verdict

WALL_BAR_S = 30.0
RSS_BAR_BYTES = 1024 * MiB  # "1 GB" read as 1 GiB would be looser; we use 1024 MiB


def llama2_70b():
    """The factory ``--model benchmarks.bench_profile_fake:llama2_70b`` names."""
    from sample_models.models import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32000,
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            hidden_dim=28672,
            max_seq_len=4096,
        )
    )


ARGV = [
    YAFSDP,
    "profile",
    "--model",
    "benchmarks.bench_profile_fake:llama2_70b",
    "--fake",
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


def main() -> bool:
    run = measure(ARGV)
    if run.returncode != 0:
        print(f"  profile --fake failed with exit {run.returncode}")
        return False
    doc = json.loads(run.stdout)
    gib = 1024**3
    for variant in ("original", "converted"):
        step = doc[variant]
        peak = step["peak"]
        parts = ", ".join(f"{k} {peak[k] / gib:.2f}" for k in peak)
        print(
            f"  {variant:<9} peak {step['peak_bytes'] / gib:8.2f} GiB ({step['peak_phase']}): "
            f"{parts} GiB; {step['ops']} ops, {step['wall_s']:.1f} s"
        )
    ok = verdict("wall time", run.wall_s, WALL_BAR_S, "s")
    ok &= verdict("peak RSS", run.peak_rss_bytes / MiB, RSS_BAR_BYTES / MiB, "MiB")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
