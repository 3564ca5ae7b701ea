"""Tiny Hugging Face architectures shared by the tests (no downloads).

Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import transformers as tf

VOCAB = 96

CLASSES = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "t5": "T5ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "bert": "BertForMaskedLM",
}


def tiny_config(name: str):
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if name == "llama":
        return tf.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, **small)
    if name == "gpt2":
        return tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16)
    if name == "t5":
        return tf.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
    if name == "mixtral":
        return tf.MixtralConfig(
            vocab_size=VOCAB,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            **small,
        )
    if name == "bert":
        return tf.BertConfig(vocab_size=VOCAB, **small)
    raise KeyError(name)


def tiny_model(name: str):
    """A freshly initialised model (seed it first)."""
    return getattr(tf, CLASSES[name])(tiny_config(name))


def deepseek_v3_shape(layers: int, experts: int = 4):
    """DeepSeek-V3's shape, tiny: multi-head latent attention, shared and ``experts``
    routed experts, and two dense layers first (``first_k_dense_replace``)."""
    return tf.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=2,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    )
