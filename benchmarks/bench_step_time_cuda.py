"""The step-time model against a GPU: predicted step time of a fake step
(``timing.count_step`` then ``timing.estimate_step`` on this GPU's row of the table)
beside the median measured step of the same step run for real on one GPU.

A Llama of TinyLlama-1.1B's shape with random weights (a transformers
``LlamaConfig``, no download), bfloat16 parameters without float32 masters, AdamW
fused, batch 4 at 2048 and 4096 tokens, activation checkpointing off and on. The
real loss is ``(logits.float() * R).sum()`` with ``R`` made on the GPU once; the
fake step's loss makes ``R`` on the host and copies it (two kernels more in the
prediction, about 1 ms at 4 x 2048). Each case runs in its own process (a fresh
allocator; a failure costs that case only); the measurement is the median of 10
steps after 3 warm-up steps, each step synchronised.

Without a CUDA device it says so and exits 0. Not a bar: it prints the figures and
writes them, with the GPU, torch's version and the date, to ``--out``.

python -m benchmarks.bench_step_time_cuda --out step_time.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.bench_reserved_cuda import TINYLLAMA

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = 90
TOTAL_S = 270  # under 5 minutes in all on an H200
WARMUP, STEPS = 3, 10
GPU_ROWS = {"H200": "H200", "H100": "H100-SXM", "A100-SXM4-80GB": "A100-80GB", "B200": "B200"}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    seq_len: int
    checkpointing: str = "none"


CASES = (
    Case("llama-1.1b 4x2048", 4, 2048),
    Case("llama-1.1b 4x2048 ckpt", 4, 2048, "non-reentrant"),
    Case("llama-1.1b 4x4096", 4, 4096),
    Case("llama-1.1b 4x4096 ckpt", 4, 4096, "non-reentrant"),
)


def build(device: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINYLLAMA))
    return model.to(torch.bfloat16)


def gpu_row(name: str) -> str:
    for key, row in GPU_ROWS.items():
        if key in name:
            return row
    return "H100-SXM"


def predict(case: Case, gpu_name: str) -> dict:
    from yafsdp_cli.engine.module_spec import spec_from_module
    from yafsdp_cli.engine.plan import plan
    from yafsdp_cli.options import StepOptions
    from yafsdp_cli.profiling import ProfileOptions
    from yafsdp_cli.timing import count_step, estimate_step, gpu_spec

    model = build("meta")
    opts = ProfileOptions(
        step=StepOptions(
            target="cuda",
            batch=case.batch,
            seq_len=case.seq_len,
            optimizer_impl="fused",
            checkpointing=case.checkpointing,
        ),
        fake=True,
    )
    costs = count_step(model, opts)
    est = estimate_step(costs, plan(spec_from_module(model)), gpu_spec(gpu_row(gpu_name)))
    return {
        "gpu_row": est.gpu,
        "step_ms": 1e3 * est.step_s,
        "forward_ms": 1e3 * est.forward_s,
        "backward_ms": 1e3 * est.backward_s,
        "optimizer_ms": 1e3 * est.optimizer_s,
        "mfu": est.mfu,
    }


def measure(case: Case) -> dict:
    import torch

    from yafsdp_cli.engine.idioms import apply_checkpointing
    from yafsdp_cli.engine.module_spec import spec_from_module
    from yafsdp_cli.engine.plan import plan

    model = build("cuda").train()
    apply_checkpointing(model, case.checkpointing, plan(spec_from_module(model)).units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, TINYLLAMA["vocab_size"], (case.batch, case.seq_len), device="cuda")
    r = torch.randn((case.batch, case.seq_len, TINYLLAMA["vocab_size"]), device="cuda", generator=g)
    times = []
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        (logits.float() * r).sum().backward()
        del logits
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return {
        "step_ms": 1e3 * statistics.median(times),
        "max_allocated": torch.cuda.max_memory_allocated(),
    }


def run_case(name: str) -> dict:
    import torch

    case = next(c for c in CASES if c.name == name)
    gpu = torch.cuda.get_device_name()
    return {"case": name, "gpu": gpu, "predicted": predict(case, gpu), "measured": measure(case)}


# -- the driver ----------------------------------------------------------------------


def run_cases(names, timeout_s: float = CASE_TIMEOUT_S) -> tuple[list[dict], list[dict]]:
    """Each case in its own process; a failure is reported and the rest go on."""
    rows, errors = [], []
    deadline = time.monotonic() + TOTAL_S
    for name in names:
        left = deadline - time.monotonic()
        if left < 20:
            errors.append({"case": name, "error": "skipped: out of time"})
            continue
        cmd = [sys.executable, "-m", "benchmarks.bench_step_time_cuda", "--case", name]
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=min(timeout_s, left)
            )
        except subprocess.TimeoutExpired:
            errors.append({"case": name, "error": f"timed out after {min(timeout_s, left):.0f} s"})
            continue
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            errors.append({"case": name, "error": tail})
            continue
        rows.append(json.loads(lines[-1]))
    return rows, errors


def print_rows(rows: list[dict]) -> None:
    print(f"{'case':26} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>10}")
    for row in rows:
        p, m = row["predicted"]["step_ms"], row["measured"]["step_ms"]
        print(f"{row['case']:26} {p:13.1f} {m:12.1f} {p / m:10.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--case", default=None, help="run one case here (the driver's child)")
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args.case)))
        return 0
    import torch

    body = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "rows": [],
        "errors": [],
    }
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        body["skipped"] = "no CUDA device"
    else:
        body["gpu"] = torch.cuda.get_device_name()
        body["cases"] = [asdict(c) for c in CASES]
        body["rows"], body["errors"] = run_cases([c.name for c in CASES])
        print_rows(body["rows"])
        for e in body["errors"]:
            print(f"{e['case']}: {e['error']}")
    if args.out:
        args.out.write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
