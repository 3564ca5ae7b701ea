"""``yafsdp verify`` on the checkpoints people have.

1. GPT-2 124M (random init, float32, saved as a Hugging Face folder here): verify's
   peak RSS over one model's training state (parameters + gradients + AdamW's two
   states, the bytes of ``estimate_memory``'s DDP column): bar 1.3.
2. A 1.1B-parameter Llama-shaped bfloat16 folder (TinyLlama's shape: 22 blocks of
   2048, 5632 intermediate, 32000 vocabulary, untied), built here and deleted after:
   ``yafsdp verify FOLDER`` with no option must pass on the machine it runs on; its wall time,
   peak RSS and the blocks it checked are printed (no bar on the time).

The folders go to ``benchmarks/data`` (git-ignored), about 0.5 GB and 2.2 GB.

python -m benchmarks.run verify          # both
python -m benchmarks.bench_verify gpt2   # one
"""

from __future__ import annotations

import json
import shutil
import sys

from .common import DATA, YAFSDP, measure, verdict

GiB = 1024**3
BAR = 1.3


def build_gpt2(path) -> None:
    import torch
    import transformers as tf

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config()).save_pretrained(path)


def build_llama_1b(path) -> None:
    import torch
    import transformers as tf

    if (path / "config.json").exists():
        return
    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model


def training_state(path) -> tuple[int, int]:
    """(parameter count, bytes of parameters + gradients + AdamW states)."""
    from yafsdp_cli.engine.plan import plan
    from yafsdp_cli.memory import MemoryConfig, estimate_memory
    from yafsdp_cli.sources import load_source

    loaded = load_source(str(path))
    cfg = MemoryConfig(optimizer="adamw", master_weights=False, round_bytes=1)
    ddp = estimate_memory(plan(loaded.spec), cfg).baseline
    numel = sum(t.numel for t in loaded.spec.params)
    return numel, ddp.params + ddp.grads + ddp.optimizer


def run_verify(path, *extra: str):
    run = measure([YAFSDP, "verify", str(path), "--json", *extra])
    report = json.loads(run.stdout)["report"] if run.stdout else {}
    return run, report


def gpt2() -> bool:
    path = DATA / "gpt2-124m"
    build_gpt2(path)
    numel, state = training_state(path)
    run, report = run_verify(path)
    print(f"  GPT-2 {numel:,} parameters, training state {state / GiB:.3f} GiB")
    print(
        f"  verify: exit {run.returncode}, {run.wall_s:.1f} s, "
        f"peak RSS {run.peak_rss_bytes / GiB:.3f} GiB"
    )
    _print_estimate(report)
    ok = run.returncode == 0
    return verdict("peak RSS / training state", run.peak_rss_bytes / state, BAR, "x") and ok


def llama_1b() -> bool:
    path = DATA / "llama-1.1b-bf16"
    try:
        build_llama_1b(path)
        numel, state = training_state(path)
        run, report = run_verify(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    print(f"  Llama-shaped {numel:,} parameters bf16, training state {state / GiB:.3f} GiB")
    print(
        f"  verify (no option): exit {run.returncode}, {run.wall_s:.1f} s, "
        f"peak RSS {run.peak_rss_bytes / GiB:.3f} GiB"
    )
    blocks = report.get("blocks") or {}
    print(f"  blocks checked: {blocks.get('kept', 'all')} ({blocks.get('why', '')})")
    _print_estimate(report)
    print(f"  comparisons {report.get('compared')}, failures {report.get('failures')}")
    return run.returncode == 0


def _print_estimate(report: dict) -> None:
    budget = report.get("budget") or {}
    est = budget.get("estimate") or {}
    if est:
        from yafsdp_cli.verify.budget import PeakEstimate

        total = budget["process_bytes"] + PeakEstimate(**est).total
        print(
            f"  estimated peak {total / GiB:.3f} GiB; available "
            f"{budget['available']['bytes'] / GiB:.2f} GiB ({budget['available']['source']}); "
            f"measured peak RSS (in-process) {report['peak_rss'] / GiB:.3f} GiB"
        )


def main(which: list[str] | None = None) -> bool:
    which = which or ["gpt2", "llama"]
    ok = True
    if "gpt2" in which:
        ok &= gpt2()
    if "llama" in which:
        ok &= llama_1b()
    return ok


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:]) else 1)
