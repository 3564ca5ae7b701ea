"""Bar: `verify` never cries wolf. A 2-layer transformers GPT-2 with dropout 0.1
(`--filter linear --optimizer sgd`, tied) is verified again and again on an unchanged
model, and every verdict must be OK:

- alone, in one process, run after run;
- two such loops side by side (both cores busy with verify);
- beside a busy process pinned to one core;
- on 2 ranks (gloo), alone and beside the busy process.

python -m benchmarks.run verify_repeat           # 200 one-rank runs, 30 on two ranks
REPEAT_SCALE=0.1 python -m benchmarks.run verify_repeat   # a tenth of each series
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALE = float(os.environ.get("REPEAT_SCALE", "1"))

# (name, runs per loop, loops side by side, ranks, busy process beside it)
SERIES = [
    ("alone", 80, 1, 1, False),
    ("two at a time", 40, 2, 1, False),
    ("beside a busy core", 40, 1, 1, True),
    ("2 ranks", 20, 1, 2, False),
    ("2 ranks beside a busy core", 10, 1, 2, True),
]

LOOP = """
import json, sys
import torch
from dataclasses import replace
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.verify import VerifyOptions, verify_source
folder, runs, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
base = VerifyOptions()
opts = VerifyOptions(
    layout=LayoutOptions(filters=("linear",), world_size=world),
    step=replace(base.step, optimizer="sgd"),
)
verdicts = []
for _ in range(runs):
    r = verify_source(folder, opts=opts)
    verdicts.append("ok" if r.ok else ("not reproducible" if not r.reproducible else "MISMATCH"))
print(json.dumps(verdicts))
"""

BUSY = "import os\nos.sched_setaffinity(0, {0})\nwhile True:\n    pass\n"


def gpt2_with_dropout(folder: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    assert config.attn_pdrop == config.resid_pdrop == 0.1  # dropout on
    tf.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def run_series(folder: Path, runs: int, loops: int, ranks: int, busy: bool) -> list[str]:
    """Every verdict of ``loops`` processes each verifying ``runs`` times."""
    hog = subprocess.Popen([sys.executable, "-c", BUSY]) if busy else None
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", LOOP, str(folder), str(runs), str(ranks)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for _ in range(loops)
        ]
        verdicts: list[str] = []
        for p in procs:
            out, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                verdicts += [f"exit {p.returncode}: {err.strip().splitlines()[-1:]}"]
                continue
            verdicts += json.loads(out.strip().splitlines()[-1])
        return verdicts
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main() -> bool:
    with tempfile.TemporaryDirectory(prefix="yafsdp-repeat-") as tmp:
        folder = gpt2_with_dropout(Path(tmp) / "gpt2")
        bad = total = 0
        for name, runs, loops, ranks, busy in SERIES:
            runs = max(1, round(runs * SCALE))
            start = time.perf_counter()
            verdicts = run_series(folder, runs, loops, ranks, busy)
            wrong = [v for v in verdicts if v != "ok"]
            bad += len(wrong) + (runs * loops - len(verdicts))
            total += runs * loops
            wall = time.perf_counter() - start
            seen = "; " + ", ".join(sorted(set(wrong))) if wrong else ""
            print(f"  {name:<28} {len(verdicts) - len(wrong):>4} of {runs * loops} OK "
                  f"({wall:.0f} s){seen}")  # fmt: skip
    ok = bad == 0
    print(f"  {'verdicts not OK':<28} {bad:>4} of {total}   bar 0   {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
