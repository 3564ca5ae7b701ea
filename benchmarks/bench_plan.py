"""Bar: ``plan`` of the Llama-2-70B config over the default grid (world sizes 1..512,
micro-batches 1,2,4,8, checkpointing none and non-reentrant, 4096 tokens, CUDA's
kernels) in at most 3x the time of one ``profile --fake --target cuda`` of it (world
size 256, batch 1), and under 1 GiB RSS. The model is transformers'
``LlamaForCausalLM`` from the config ``meta-llama/Llama-2-70b-hf`` ships
(``bench_profile_fake.write_config``). The plan runs its fake steps on as many
processes as it chooses (``--jobs``, default: the cores); its RSS is the sum over
them, sampled (``TreeRss``). The two commands are run alternately (paired) and the
medians compared, since the machine is shared.

python -m benchmarks.run plan
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.bench_profile_fake import argv as profile_argv
from benchmarks.bench_profile_fake import write_config
from benchmarks.common import YAFSDP, MiB, TreeRss, measure, verdict

RATIO_BAR = 3.0
RSS_BAR_BYTES = 1024 * MiB
PAIRS = 3  # a pair is about 40 s on a 2-core machine


def plan_argv(folder: Path) -> list[str]:
    return [YAFSDP, "plan", str(folder), "--gpu-memory", "80GiB", "--seq-len", "4096", "--json"]


def main() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(write_config(Path(tmp) / "Llama-2-70b-hf"))


def _run(folder: Path) -> bool:
    plans, floors, rss = [], [], 0
    for _ in range(PAIRS):
        floor = measure(profile_argv(folder, "cuda"))
        with TreeRss() as tree:
            run = measure(plan_argv(folder))
        if run.returncode != 0 or floor.returncode != 0:
            print(f"  plan exit {run.returncode}, profile --fake exit {floor.returncode}")
            return False
        plans.append(run.wall_s)
        floors.append(floor.wall_s)
        rss = max(rss, run.peak_rss_bytes, tree.peak)  # workers' resident memory summed
    doc = json.loads(run.stdout)
    best = doc["best"]
    print(
        f"  {doc['fake_runs']} fake runs from {doc['fake_steps']} fake steps; best: world size "
        f"{best['world_size']}, micro-batch "
        f"{best['micro_batch']}, checkpointing {best['checkpointing']}"
        if best
        else "  nothing fits"
    )
    plan_s, floor_s = statistics.median(plans), statistics.median(floors)
    cpu = f"plan CPU {run.cpu_s:.1f} s, profile CPU {floor.cpu_s:.1f} s"
    print(f"  plan {plan_s:.1f} s, profile --fake {floor_s:.1f} s (medians of {PAIRS}); {cpu}")
    ok = verdict("plan / profile --fake", plan_s / floor_s, RATIO_BAR, "x")
    ok &= verdict("peak RSS", rss / MiB, RSS_BAR_BYTES / MiB, "MiB")
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
