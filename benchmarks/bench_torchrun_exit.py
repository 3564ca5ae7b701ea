"""Bar: docs/verify.md's torchrun line exits 0 on every one of 50 launches (no rank aborts
at exit, no hang), and rank 0 alone prints the verdict.

torchrun --nproc-per-node 2 --no-python yafsdp verify sample_models/gpt.safetensors \
    --model sample_models.models:gpt --world-size 2

python -m benchmarks.run torchrun_exit      # RUNS=10 for a shorter series
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

RUNS = int(os.environ.get("RUNS", "50"))
ROOT = Path(__file__).resolve().parents[1]


def main() -> bool:
    bindir = Path(sys.executable).parent
    argv = [str(bindir / "torchrun"), "--nproc-per-node", "2", "--no-python",
            str(bindir / "yafsdp"), "verify", "sample_models/gpt.safetensors",
            "--model", "sample_models.models:gpt", "--world-size", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    codes: Counter = Counter()
    bad = 0
    start = time.perf_counter()
    for _ in range(RUNS):
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        codes[done.returncode] += 1
        clean = done.returncode == 0 and done.stdout.count("OK: converted model matches") == 1
        bad += not clean or "terminate called" in done.stderr
    wall = time.perf_counter() - start
    print(f"  {RUNS} launches in {wall:.0f} s; exit codes {dict(codes)}; unclean {bad}")
    ok = bad == 0
    print(f"  {'clean exits':<28} {RUNS - bad:>10} of {RUNS}   bar {RUNS} of {RUNS}   "
          f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    return ok
