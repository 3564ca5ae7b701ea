"""``profile --fake --target cuda`` (CPU tensors, CUDA's kernels substituted) against a
real step on a GPU: our tracker's peak and ``torch.cuda.max_memory_allocated``.

Needs a CUDA device; elsewhere it says so and passes (nothing to compare). Not a bar:
it prints both figures, labelled with the GPU, into benchmarks/RESULTS.md, which
docs/profile.md's ``--target cuda`` section cites.

python -m benchmarks.run profile_cuda
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

MODELS = {
    # a tiny Llama (flash in bf16) and GPT-2 (attention dropout: math on the CPU)
    "llama bf16": ("LlamaConfig", "LlamaForCausalLM", "bfloat16"),
    "gpt2 fp32": ("GPT2Config", "GPT2LMHeadModel", "float32"),
}
WIDTH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024)


def write_folder(root: Path, name: str) -> Path:
    import transformers as tf

    config_cls, arch, dtype = MODELS[name]
    kw = dict(WIDTH, num_attention_heads=4)
    if config_cls == "GPT2Config":
        kw = dict(n_embd=256, n_layer=2, n_head=4, vocab_size=1024, n_positions=4096)
    cfg = getattr(tf, config_cls)(**kw)
    cfg.architectures, cfg.dtype = [arch], dtype
    path = root / name.replace(" ", "-")
    cfg.save_pretrained(path)
    return path


def main() -> bool:
    import torch

    if not torch.cuda.is_available():
        print("  no CUDA device here: nothing to compare (run it where one is)")
        return True
    from yafsdp_cli.options import StepOptions
    from yafsdp_cli.profiling import ProfileOptions, profile_model
    from yafsdp_cli.sources import load_source

    print(f"  GPU: {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            path = write_folder(Path(tmp), name)
            step = StepOptions(batch=1, seq_len=2048)
            on = dataclasses.replace(step, target="cuda")
            fake = profile_model(load_source(path), ProfileOptions(step=on, fake=True))
            real = profile_model(
                load_source(path), ProfileOptions(step=dataclasses.replace(step, device="cuda"))
            )
            for f, r in (
                (fake.original, real.original),
                (fake.converted_step, real.converted_step),
            ):
                cuda = r.cuda.allocated_peak if r.cuda else 0
                print(
                    f"  {name:<10} {f.variant:<9} fake --target cuda {f.peak.total:>13,} B  "
                    f"real tracker {r.peak.total:>13,} B  max_memory_allocated {cuda:>13,} B  "
                    f"fake/allocated {f.peak.total / cuda if cuda else float('nan'):.3f}"
                )
    return True


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
