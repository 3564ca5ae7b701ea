"""Rebuild the committed sample checkpoints, deterministically.

    python -m sample_models.build [OUT_DIR]   # default: this folder

Each model is built from its factory under ``torch.manual_seed(0)``; the same torch
version writes the same bytes. Files:

- ``mlp.safetensors``, ``mlp.pt`` (plain state dict)
- ``cnn.safetensors`` (BatchNorm statistics as buffers)
- ``gpt.safetensors`` (tied embedding stored once, alias in the metadata, as
  ``safetensors.torch.save_model`` writes it), ``gpt.pt`` (state dict whose tied
  names share one storage), ``gpt_module.pt`` (whole pickled module)
- ``llama.safetensors`` (bf16 matrices, fp32 norms, a rotary buffer)
- ``moe.safetensors`` (mixture of experts, tied embedding)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from safetensors.torch import save_model  # noqa: E402

from sample_models.models import FACTORIES  # noqa: E402

HERE = Path(__file__).resolve().parent


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FACTORIES[name]()
    if name == "cnn":  # give the BatchNorm buffers non-trivial statistics
        model.train()
        with torch.no_grad():
            model(torch.randn(8, 3, 16, 16))
    return model.eval()


def main(out: Path = HERE) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in FACTORIES:
        model = build(name)
        save_model(model, str(out / f"{name}.safetensors"))
        if name in ("mlp", "gpt"):
            torch.save(model.state_dict(), out / f"{name}.pt")
        if name == "gpt":
            torch.save(model, out / "gpt_module.pt")
        print(f"wrote {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
