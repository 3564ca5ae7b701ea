"""A step's kernels counted on a few layers of its stack and written at its depth
equal the kernels counted on the whole model, kernel for kernel; where the layers
are not periodic, the whole model is counted and ``counted`` says why."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import options

from yafsdp_cli.options import StepOptions
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing.step_costs import count_step

tf = pytest.importorskip("transformers")

from hf_models import deepseek_v3_shape  # noqa: E402 - after the skip


def _folder(tmp_path, config) -> str:
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    return str(folder)


def _counts(loaded, **step):
    opts = ProfileOptions(
        step=options(StepOptions, **{"batch": 2, "seq_len": 16, "target": "cuda", **step}),
        fake=True,
    )
    return count_step(loaded, opts), count_step(loaded, opts, periodic=False)


def _assert_same(loaded, **step):
    periodic, whole = _counts(loaded, **step)
    assert periodic.counted.endswith("a period repeated, checked"), periodic.counted
    assert whole.counted == ""
    assert dataclasses.replace(periodic, counted="") == whole
    return periodic


LLAMA = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=16,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.mark.parametrize(
    "step",
    [
        {},
        {"checkpointing": "non-reentrant"},
        {"checkpointing": "reentrant", "optimizer_impl": "for-loop"},
        {"param_dtype": "bf16", "optimizer_impl": "fused"},
        {"target": "cpu", "optimizer": "sgd"},
    ],
    ids=["foreach", "non-reentrant", "reentrant-for-loop", "bf16-fused", "cpu-sgd"],
)
def test_llama_counted_on_three_depths_equals_whole(tmp_path, step):
    loaded = load_source(_folder(tmp_path, tf.LlamaConfig(**LLAMA)))
    costs = _assert_same(loaded, **step)
    assert costs.counted.startswith("3, 4, 5 of 16 layers")


def test_alternating_attention_and_sparse_layers(tmp_path):
    # a period of 2 counts 6, 8 and 10 layers: worth it from 25 layers on
    gemma = tf.Gemma2Config(**{**LLAMA, "num_hidden_layers": 26}, head_dim=8, sliding_window=4)
    assert _assert_same(load_source(_folder(tmp_path / "g", gemma))).counted.startswith(
        "6, 8, 10 of 26 layers"
    )
    moe = tf.Qwen3MoeConfig(
        **{**LLAMA, "num_hidden_layers": 26},
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
    )
    _assert_same(load_source(_folder(tmp_path / "q", moe)), checkpointing="non-reentrant")


def test_dense_first_layers_are_a_prefix(tmp_path):
    config = deepseek_v3_shape(24)
    costs = _assert_same(load_source(_folder(tmp_path, config)))
    assert costs.counted.startswith("5, 6, 7 of 24 layers")


@pytest.mark.parametrize("odd", [3, 4, 11])
def test_a_planted_layer_that_differs_is_counted_whole(odd):
    """Layer 3 is in the second and third counts, layer 4 in the third alone: either
    way the written third count is not the counted one. Layer 11 is in none of them:
    the one blind spot, a layer like the others in every parameter and setting that
    runs other kernels past the depths counted."""
    loaded = load_source(None, model=f"stack_models:deep_odd_at_{odd}")
    periodic, whole = _counts(loaded, batch=2)
    if odd == 11:
        assert periodic.counted.endswith("checked")
        assert len(periodic.ops) < len(whole.ops)
        return
    assert periodic.counted.startswith("16 layers: the kernels written two periods deeper")
    assert dataclasses.replace(periodic, counted="") == whole


def test_counting_twice_gives_the_same_kernels(tmp_path):
    loaded = load_source(_folder(tmp_path, tf.LlamaConfig(**LLAMA)))
    runs = [_counts(loaded, checkpointing="non-reentrant")[0] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
