"""The fake step's counted FLOPs against the analytic count, and what each op costs.

Analytic training FLOPs of a decoder: ``6 * N * T`` for the products with its
weight matrices (``N``: the elements of every ``Linear``/``Conv1D`` weight, the
output head included; ``T``: tokens) plus ``12 * L * S^2 * d`` per sequence for
attention (``L`` layers, ``S`` tokens a sequence, ``d`` the query heads' width):
two ``S x S x d`` products forward, twice that backward.
"""

from __future__ import annotations

import pytest
import torch
from helpers import options

from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.timing import count_step
from yafsdp_cli.timing.op_costs import launches_kernel

tf = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

aten = torch.ops.aten
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=96, num_key_value_heads=2, **SMALL))


def gpt2():
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=128)
    return tf.GPT2LMHeadModel(cfg)


def meta(factory):
    torch.manual_seed(0)
    with torch.device("meta"):
        return factory()


def analytic(model, batch: int, seq: int) -> int:
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D)))
    cfg = model.config
    return 6 * n * batch * seq + 12 * cfg.num_hidden_layers * seq**2 * cfg.hidden_size * batch


def opts(**kw) -> ProfileOptions:
    return options(ProfileOptions, fake=True, target="cuda", **{"batch": 2, "seq_len": 128, **kw})


@pytest.mark.parametrize("factory", [llama, gpt2], ids=["llama", "gpt2"])
def test_model_flops_match_the_analytic_count(factory):
    model = meta(factory)
    costs = count_step(model, opts())
    want = analytic(model, 2, 128)
    assert abs(costs.model_flops - want) <= 0.02 * want, (costs.model_flops, want)
    assert costs.phase("backward").model_flops == 2 * costs.phase("forward").model_flops
    assert costs.tokens == 256 and costs.params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointing_recomputes_the_units_forward_and_is_not_model_work(mode):
    model = meta(llama)
    plain = count_step(model, opts())
    ckpt = count_step(model, opts(checkpointing=mode))
    assert ckpt.model_flops == plain.model_flops
    extra = sum(ckpt.phase("backward").matrix_flops.values()) - sum(
        plain.phase("backward").matrix_flops.values()
    )
    head = 2 * 32 * 96 * 256  # lm_head is outside the checkpointed layers
    assert extra == ckpt.phase("backward").recompute_flops
    units_forward = sum(plain.phase("forward").matrix_flops.values()) - head
    if mode == "reentrant":
        assert extra == units_forward
    else:  # stops once the tensors backward needs are back: not the last products
        assert 0.5 * units_forward < extra < units_forward
    assert plain.phase("backward").recompute_flops == 0


def test_causal_flash_attention_counts_half_its_square_and_backward_recomputes():
    costs = count_step(meta(llama), opts(param_dtype="bf16"))
    assert costs.attention == {"flash": 2}
    fwd = [o for o in costs.ops if o.name.startswith("aten._scaled_dot_product_flash_attention.")]
    bwd = [o for o in costs.ops if "flash_attention_backward" in o.name]
    assert len(fwd) == len(bwd) == 2
    square = 2 * 2 * 2 * 4 * 128 * 128 * 8  # 2 products x 2 FLOPs x batch x heads x S^2 x d
    assert all(o.model_flops == square and o.matrix_flops == square // 2 for o in fwd)
    # backward: 4 products of model work; the kernel runs 5 (scores again), half of them
    assert all(o.model_flops == 2 * square and o.matrix_flops == 5 * square // 4 for o in bwd)
    assert costs.phase("forward").matrix_flops.keys() == {"bfloat16"}


def test_fused_adamw_reads_and_writes_each_state_once():
    model = meta(llama)
    costs = count_step(model, opts(optimizer_impl="fused"))
    (fused,) = [o for o in costs.ops if "_fused_adamw_" in o.name]
    p, tensors = costs.params, len(list(model.parameters()))
    # reads parameter, gradient, two states; writes parameter and two states (float32)
    # and reads one 4-byte step counter per tensor (a foreach add steps them before)
    assert fused.bytes == 7 * 4 * p + 4 * tensors
    assert fused.phase == "optimizer" and fused.matrix_flops == 0


def test_views_and_metadata_launch_no_kernel():
    assert not launches_kernel(aten.view.default)
    assert not launches_kernel(aten.t.default)
    assert not launches_kernel(aten.empty.memory_format)
    assert not launches_kernel(torch.ops.prim.device.default)
    assert launches_kernel(aten.add_.Tensor)
    assert launches_kernel(aten.mm.default)
    assert launches_kernel(aten._foreach_mul_.Scalar)


def test_an_embedding_reads_the_rows_it_looks_up():
    costs = count_step(meta(llama), opts())
    (emb,) = [o for o in costs.ops if o.name == "aten.embedding.default"]
    rows = 2 * 128 * 32 * 4  # (batch, seq, hidden) float32
    assert emb.bytes == 2 * rows + 2 * 128 * 8  # rows read and written, int64 indices
