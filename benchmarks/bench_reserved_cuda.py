"""The caching allocator's model against a GPU: predicted reserved memory of a fake
step (``profile --fake --target cuda``, its trace replayed by
``memory.caching_allocator``) beside ``torch.cuda.max_memory_reserved`` of the same
step run for real, and the fake peak beside ``torch.cuda.max_memory_allocated``.

Realistic shapes with random weights (transformers configs, no download): a Llama
of TinyLlama-1.1B's shape, Qwen2-0.5B's shape (tied embeddings), a small Mixtral
(MoE), GPT-2 124M in float32 with dropout; 16-bit ones train as ``plan`` assumes
(bfloat16 parameters, float32 masters, AdamW foreach), with and without activation
checkpointing, one case with ``expandable_segments:True``. Each case runs in its own
process (a fresh allocator, and a failure costs only that case); a failed case
prints its error and the rest go on.

The real step starts from an emptied cache (``torch.cuda.empty_cache`` before the
tracked step), as the replay starts from none: what model building and the
warm-up step leave cached is not part of the step's trace.

Without a CUDA device it says so and exits 0 (nothing to compare). Not a bar: it
prints the figures and writes them, with the GPU and the date, to ``--out``.

python -m benchmarks.bench_reserved_cuda --out reserved.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE_TIMEOUT_S = 150  # one case, at most
TOTAL_S = 390  # all cases: what is left after this is skipped (under 7 minutes in all)


@dataclass(frozen=True)
class Case:
    name: str
    config: str  # transformers config class
    arch: str
    shape: dict = field(default_factory=dict)
    param_dtype: str | None = "bfloat16"  # None: float32 as built
    batch: int = 2
    seq_len: int = 2048
    checkpointing: str = "none"
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF for the real run and the replay


TINYLLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=4096,
)
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
MIXTRAL_SMALL = dict(  # about 0.6B parameters, 8 experts, 2 per token
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=4096,
)
GPT2_124M = dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)

# the first ones matter most: later ones are skipped if the time runs out
CASES = (
    Case(
        "llama-1.1b ckpt",
        "LlamaConfig",
        "LlamaForCausalLM",
        TINYLLAMA,
        seq_len=4096,
        checkpointing="non-reentrant",
    ),
    Case("qwen2-0.5b", "Qwen2Config", "Qwen2ForCausalLM", QWEN2_05B),
    Case("mixtral-0.6b", "MixtralConfig", "MixtralForCausalLM", MIXTRAL_SMALL, batch=1),
    Case("gpt2-124m fp32", "GPT2Config", "GPT2LMHeadModel", GPT2_124M, None, 2, 1024),
    Case("llama-1.1b", "LlamaConfig", "LlamaForCausalLM", TINYLLAMA),
    Case(
        "llama-1.1b ckpt expandable",
        "LlamaConfig",
        "LlamaForCausalLM",
        TINYLLAMA,
        seq_len=4096,
        checkpointing="non-reentrant",
        alloc_conf="expandable_segments:True",
    ),
)


# -- one case (in its own process) ---------------------------------------------------


def write_folder(case: Case, root: Path) -> Path:
    """A config-only Hugging Face folder: weights are random (real) or fake."""
    import transformers as tf

    cfg = getattr(tf, case.config)(**case.shape)
    cfg.architectures = [case.arch]
    cfg.dtype = "float32"
    path = root / case.name.replace(" ", "-")
    cfg.save_pretrained(path)
    return path


def options(case: Case, fake: bool):
    from yafsdp_cli.options import StepOptions
    from yafsdp_cli.profiling import ProfileOptions

    where = dict(target="cuda") if fake else dict(device="cuda")
    step = StepOptions(
        batch=case.batch,
        seq_len=case.seq_len,
        checkpointing=case.checkpointing,
        param_dtype=case.param_dtype,
        optimizer_impl="foreach",
        **where,
    )
    return ProfileOptions(step=step, fake=fake)


def predict(case: Case, path: Path) -> dict[str, dict]:
    """The fake step's peak and its trace's predicted reserved bytes, per variant."""
    from yafsdp_cli.memory import reserved_of
    from yafsdp_cli.profiling import profile_model
    from yafsdp_cli.sources import load_source

    traces: dict = {}
    start = time.perf_counter()
    report = profile_model(load_source(path), options(case, fake=True), traces=traces)
    fake_s = time.perf_counter() - start
    out = {}
    for step in (report.original, report.converted_step):
        start = time.perf_counter()
        est = reserved_of(traces[step.variant], case.alloc_conf or None)
        out[step.variant] = dict(
            fake_allocated=step.peak.total,
            predicted_reserved=est.reserved_peak,
            predicted_fragmentation=est.fragmentation,
            predicted_allocator_allocated=est.allocated_peak,
            trace_events=est.events,
            replay_s=round(time.perf_counter() - start, 3),
            fake_step_s=round(fake_s, 3),
        )
    return out


def measure(case: Case, path: Path) -> dict[str, dict]:
    """The real step's CUDA peaks, from an emptied cache, and its own trace replayed."""
    import torch

    from yafsdp_cli.memory import reserved_of
    from yafsdp_cli.profiling import profile_model
    from yafsdp_cli.profiling import run as profile_run
    from yafsdp_cli.sources import load_source

    reset = profile_run._cuda_reset

    def empty_then_reset(device):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return reset(device)

    profile_run._cuda_reset = empty_then_reset
    traces: dict = {}
    try:
        report = profile_model(load_source(path), options(case, fake=False), traces=traces)
    finally:
        profile_run._cuda_reset = reset
    out = {}
    for step in (report.original, report.converted_step):
        est = reserved_of(traces[step.variant], case.alloc_conf or None)
        out[step.variant] = dict(
            real_tracker_peak=step.peak.total,
            cuda_allocated=step.cuda.allocated_peak,
            cuda_reserved=step.cuda.reserved_peak,
            real_trace_reserved=est.reserved_peak,
        )
    return out


def run_case(name: str) -> list[dict]:
    case = next((c for c in CASES if c.name == name), None)
    if case is None:
        raise SystemExit(f"no case {name!r}; have {', '.join(c.name for c in CASES)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_folder(case, Path(tmp))
        fake = predict(case, path)
        real = measure(case, path)
    rows = []
    for variant in fake:
        row = dict(case=case.name, variant=variant, alloc_conf=case.alloc_conf or "default")
        row.update(fake[variant], **real[variant])
        row["allocated_ratio"] = round(row["fake_allocated"] / row["cuda_allocated"], 4)
        row["reserved_ratio"] = round(row["predicted_reserved"] / row["cuda_reserved"], 4)
        rows.append(row)
    return rows


# -- all cases ------------------------------------------------------------------------


def run_cases(
    names: list[str], timeout_s: float = CASE_TIMEOUT_S, total_s: float = TOTAL_S
) -> tuple[list, list]:
    """Each case in a child process; its rows, or its error (and the rest go on)."""
    rows, errors = [], []
    deadline = time.perf_counter() + total_s
    for name in names:
        left = deadline - time.perf_counter()
        if left < 20:
            errors.append(dict(case=name, error="skipped: out of time"))
            print(f"  {name}: skipped, out of time")
            continue
        with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
            cmd = [sys.executable, "-m", "benchmarks.bench_reserved_cuda", "--case", name]
            env = dict(os.environ)
            conf = next((c.alloc_conf for c in CASES if c.name == name), "")
            if conf:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    [*cmd, "--case-out", out.name],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=min(timeout_s, left),
                )
            except subprocess.TimeoutExpired:
                took = time.perf_counter() - start
                errors.append(dict(case=name, error=f"timed out after {took:.0f} s"))
                print(f"  {name}: timed out after {took:.0f} s")
                continue
            took = time.perf_counter() - start
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                errors.append(dict(case=name, error=tail[0], stderr=done.stderr[-4000:]))
                print(f"  {name}: FAILED ({took:.0f} s): {tail[0]}")
                continue
            case_rows = json.loads(Path(out.name).read_text() or "[]")
            for row in case_rows:
                row["case_s"] = round(took, 1)
                print_row(row)
            rows += case_rows
    return rows, errors


def print_row(r: dict) -> None:
    print(
        f"  {r['case']:<27} {r['variant']:<9} "
        f"allocated fake {r['fake_allocated']:>15,} cuda {r['cuda_allocated']:>15,} "
        f"x{r['allocated_ratio']:.3f}  reserved predicted {r['predicted_reserved']:>15,} "
        f"cuda {r['cuda_reserved']:>15,} x{r['reserved_ratio']:.3f}  "
        f"(real trace replayed {r['real_trace_reserved']:,}; replay {r['replay_s']} s "
        f"of {r['trace_events']} events, fake step {r['fake_step_s']} s)"
    )


def write(out: Path | None, body: dict) -> None:
    if out is not None:
        out.write_text(json.dumps(body, indent=2) + "\n")
        print(f"  wrote {out}")


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows here (JSON)")
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # a child process's one case
    parser.add_argument("--case-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args([] if argv is None else argv)
    if args.case:
        args.case_out.write_text(json.dumps(run_case(args.case)))
        return True
    import torch

    stamp = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__
    )
    if not torch.cuda.is_available():
        print("  no CUDA device here: skipped, nothing to compare (run it where one is)")
        write(args.out, dict(stamp, gpu=None, skipped="no CUDA device", rows=[], errors=[]))
        return True
    gpu = torch.cuda.get_device_name()
    print(f"  GPU: {gpu}, torch {torch.__version__}")
    start = time.perf_counter()
    rows, errors = run_cases(args.cases or [c.name for c in CASES])
    print(f"  {len(rows)} rows, {len(errors)} failed cases, {time.perf_counter() - start:.0f} s")
    write(
        args.out, dict(stamp, gpu=gpu, rows=rows, errors=errors, cases=[asdict(c) for c in CASES])
    )
    return True


if __name__ == "__main__":
    raise SystemExit(0 if main(sys.argv[1:]) else 1)
