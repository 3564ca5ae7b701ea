"""Bar: under ``torch.compile`` the converted model compiles to the graphs the
original does (no graph break per parameter, no recompile storm) and a compiled
training step takes at most 1.05x the compiled original's (paired median).

The model is a transformers ``LlamaForCausalLM`` (4 layers, hidden 256, float32),
batch 4 x 128 tokens; the step is forward, loss, backward, AdamW (the converted
model's on its flat buffers) and ``zero_grad``, compiled with the default inductor
backend on the CPU. Graph and break counts come from ``torch._dynamo.explain``.

As in ``bench_step``, the bar is judged with memory reused between steps (glibc told
not to ``mmap`` large blocks, as CUDA's caching allocator reuses them); the run with
glibc's defaults is printed beside it. What the converted step does more is one copy
of each gradient into the flat gradient per step (the first micro-batch of a step;
later ones add in place), into a buffer that glibc's defaults page-fault in afresh.

python -m benchmarks.run compile
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

PAIRS = 10
WARMUP = 3
TIME_BAR = 1.05
BATCH, SEQ = 4, 128


def bench_model():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    return tf.LlamaForCausalLM(cfg).eval()  # no dropout in Llama; eval keeps HF quiet


def _step(model, opt, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids).logits.float().square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def graphs(model, ids) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids)
    return explained.graph_count, explained.graph_break_count


def measure() -> dict:
    from yafsdp_cli import convert_module, plan, spec_from_module

    original = bench_model()
    converted = copy.deepcopy(original)
    flat = convert_module(converted, plan(spec_from_module(converted)))
    ids = torch.randint(0, 8000, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    counts = {
        name: graphs(m, ids) for name, m in (("original", original), ("converted", converted))
    }
    torch._dynamo.reset()
    runs = [
        (torch.compile(original), torch.optim.AdamW(original.parameters(), foreach=True)),
        (torch.compile(converted), torch.optim.AdamW(flat.parameters(), foreach=True)),
    ]
    for _ in range(WARMUP):  # compiles, then reaches steady state
        for model, opt in runs:
            _step(model, opt, ids)
    a, b = [], []
    for i in range(PAIRS):  # alternate, and alternate who goes first
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for k in order:
            (a, b)[k].append(_step(*runs[k], ids))
    ratio = statistics.median(y / x for x, y in zip(a, b))
    return {
        "counts": counts,
        "original": statistics.median(a),
        "converted": statistics.median(b),
        "ratio": ratio,
        "threads": torch.get_num_threads(),
    }


def in_child(env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    argv = [sys.executable, "-m", "benchmarks.bench_compile", "--measure"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> bool:
    from benchmarks.bench_step import REUSE
    from benchmarks.common import verdict

    ok = True
    for label, env, judged in (("memory reuse", REUSE, True), ("glibc default", {}, False)):
        r = in_child(env)
        for name, (g, b) in r["counts"].items():
            print(f"  {name}: {g} graph(s), {b} graph break(s)")
        print(
            f"  compiled step, {label}: original {r['original']:.3f} s, converted "
            f"{r['converted']:.3f} s (medians of {PAIRS} alternating pairs, {r['threads']} threads)"
        )
        same = r["counts"]["converted"] == r["counts"]["original"]
        print(f"  {'same graphs and breaks':<28} {'yes' if same else 'NO':>10}")
        ok &= same
        if judged:
            ok &= verdict("compiled step ratio", r["ratio"], TIME_BAR, "x")
        else:
            print(f"  {'compiled step ratio (info)':<28} {r['ratio']:10.3f} x")
    return ok


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
    else:
        raise SystemExit(0 if main() else 1)
