"""Hugging Face model folders for the README's examples, made here (no download).

python -m sample_models.hf_folders [DIR]     # default: the current folder

- ``tiny-llama/``: a 2-layer ``LlamaForCausalLM`` (hidden 64), seeded weights;
- ``tiny-gpt2/``: a 2-layer ``GPT2LMHeadModel`` (tied ``lm_head``, dropout 0.1);
- ``Llama-2-70b-hf/``: the ``config.json`` of Llama-2-70B alone (its published
  hyperparameters), which ``inspect``, ``profile --fake`` and ``plan`` read without
  weights: the architecture is built on the meta device;
- ``mpt-7b-shape/``: a ``config.json`` alone, ``GPT2LMHeadModel`` with MPT-7B's
  shapes (hidden 4096, 32 layers and heads, MLP 16384, vocabulary 50368, tied
  embedding, 8192 positions; GPT-2's learned position table and biases add 0.5% to
  MPT's 6.7B parameters): the model of llm-foundry's published MPT-7B throughput rows;
- ``tiny-llama-lora/``: where peft is installed, a LoRA adapter (r=8 on q_proj and
  v_proj) over ``tiny-llama/``, as ``PeftModel.save_pretrained`` writes it, its base
  named by a path relative to the adapter folder.
"""

from __future__ import annotations

import sys
from pathlib import Path


def llama_2_70b_config():
    import transformers as tf

    return tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        dtype="float16",
    )


def mpt_7b_shape_config():
    import transformers as tf

    return tf.GPT2Config(
        vocab_size=50368,
        n_embd=4096,
        n_layer=32,
        n_head=32,
        n_inner=16384,
        n_positions=8192,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )


def write(out: Path) -> list[Path]:
    import torch
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    )
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_positions=512)
    )
    written = []
    for name, model in (("tiny-llama", llama), ("tiny-gpt2", gpt2)):
        model.save_pretrained(out / name)
        written.append(out / name)
    llama_2_70b_config().save_pretrained(out / "Llama-2-70b-hf")
    written.append(out / "Llama-2-70b-hf")
    mpt_7b_shape_config().save_pretrained(out / "mpt-7b-shape")
    written.append(out / "mpt-7b-shape")
    adapter = write_adapter(out / "tiny-llama-lora", out / "tiny-llama")
    return written + ([adapter] if adapter else [])


def write_adapter(out: Path, base: Path) -> Path | None:
    """A LoRA adapter over ``base`` (None where peft is not installed)."""
    import json

    import torch
    import transformers as tf

    try:
        import peft
    except ImportError:
        return None
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(model, config).save_pretrained(out)
    settings = out / "adapter_config.json"
    doc = json.loads(settings.read_text())
    doc["base_model_name_or_path"] = "../tiny-llama"  # relative: the folders move together
    settings.write_text(json.dumps(doc, indent=2))
    return out


if __name__ == "__main__":
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else ".")):
        print(path)
