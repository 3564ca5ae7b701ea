"""Bars: ``plan`` over the default grid (world sizes 1..512, micro-batches 1,2,4,8,
checkpointing none and non-reentrant, CUDA's kernels, every cell measured by a fake
step and replayed), each beside one ``profile --fake --target cuda`` of the same
model at world size 256, batch 1 (the floor, in the same run):

- the Llama-2-70B config (``bench_profile_fake.write_config``), 4096 tokens,
  ``--gpu h100-sxm`` (memory and step time): at most 20 s;
- the Llama-3-8B config, 8192 tokens, ``--gpu h100-sxm``: at most 10 s;
- the 70B plan with ``--scheme all``: at most 2x the 70B plan;
- the resident memory of a plan, summed over its worker processes: at most 1 GiB.

The plans run their fake steps on as many processes as they choose (``--jobs``,
default: the cores). Each command is run ``PAIRS`` times, alternating with its
floor, and the medians compared, since the machine is shared.

python -m benchmarks.run plan
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.bench_profile_fake import LLAMA2_70B, write_config
from benchmarks.common import YAFSDP, MiB, TreeRss, measure, verdict

BAR_70B_S = 20.0
BAR_8B_S = 10.0
SCHEMES_BAR = 2.0
RSS_BAR_BYTES = 1024 * MiB
PAIRS = 2

# meta-llama/Meta-Llama-3-8B config.json (the fields transformers reads)
LLAMA3_8B = {
    **LLAMA2_70B,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def plan_argv(folder: Path, seq_len: int, *extra: str) -> list[str]:
    return [YAFSDP, "plan", str(folder), "--gpu", "h100-sxm", "--seq-len", str(seq_len),
            *extra, "--json"]  # fmt: skip


def profile_argv(folder: Path, seq_len: int) -> list[str]:
    return [YAFSDP, "profile", str(folder), "--fake", "--target", "cuda", "--world-size", "256",
            "--batch", "1", "--seq-len", str(seq_len), "--json"]  # fmt: skip


def timed(argv: list[str], floor: list[str], rss: list[int]):
    """Medians of ``PAIRS`` runs of ``argv`` and of ``floor``; its last JSON document."""
    runs, floors, doc = [], [], None
    for _ in range(PAIRS):
        base = measure(floor)
        with TreeRss() as tree:
            run = measure(argv)
        if run.returncode != 0 or base.returncode != 0:
            print(f"  {argv[1]} exit {run.returncode}, floor exit {base.returncode}")
            return None
        runs.append(run.wall_s)
        floors.append(base.wall_s)
        rss.append(max(run.peak_rss_bytes, tree.peak))  # workers' resident memory summed
        doc = json.loads(run.stdout)
    return statistics.median(runs), statistics.median(floors), doc


def describe(name: str, got) -> None:
    plan_s, floor_s, doc = got
    best = doc["best"]
    where = (
        f"best {best['world_size']} GPUs x micro-batch {best['micro_batch']}, "
        f"{best['checkpointing']}"
        if best
        else "nothing fits"
    )
    print(
        f"  {name}: {doc['fake_runs']} cells from {doc['fake_steps']} fake steps and "
        f"{doc['timing']['count_runs']} counts; {where}; plan {plan_s:.1f} s, profile --fake "
        f"{floor_s:.1f} s ({plan_s / floor_s:.2f}x; medians of {PAIRS})"
    )


def main() -> bool:
    rss: list[int] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        big = write_config(Path(tmp) / "Llama-2-70b-hf")
        small = write_config(Path(tmp) / "Meta-Llama-3-8B", LLAMA3_8B)
        big_plan = timed(plan_argv(big, 4096), profile_argv(big, 4096), rss)
        small_plan = timed(plan_argv(small, 8192), profile_argv(small, 8192), rss)
        schemes = timed(plan_argv(big, 4096, "--scheme", "all"), plan_argv(big, 4096), rss)
    if not (big_plan and small_plan and schemes):
        return False
    describe("Llama-2-70B, 4096 tokens", big_plan)
    describe("Llama-3-8B, 8192 tokens", small_plan)
    print(f"  --scheme all {schemes[0]:.1f} s, plan {schemes[1]:.1f} s (medians of {PAIRS})")
    ok &= verdict("plan 70B --gpu", big_plan[0], BAR_70B_S, "s")
    ok &= verdict("plan 8B --gpu", small_plan[0], BAR_8B_S, "s")
    ok &= verdict("--scheme all / plan", schemes[0] / schemes[1], SCHEMES_BAR, "x")
    ok &= verdict("peak RSS (with workers)", max(rss) / MiB, RSS_BAR_BYTES / MiB, "MiB")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
