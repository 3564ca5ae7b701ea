"""The selective checkpointing modes as ``apply_checkpointing`` applies them: the
policy's decisions op by op, which of transformers' layers stay checkpointed under
``selective:layer=N``, the plain modes untouched, and a converted model trained under
each mode equal to the original bit for bit (``yafsdp verify``, 1 and 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine.idioms import apply_checkpointing
from yafsdp_cli.engine.selective import SAVE_LIST, op_policy

tf = pytest.importorskip("transformers")
from hf_models import tiny_config  # noqa: E402 - after the skip

aten = torch.ops.aten
runner = CliRunner()
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _decide(policy, func, *args, recompute: bool = False, **kwargs):
    return policy(SelectiveCheckpointContext(is_recompute=recompute), func, *args, **kwargs)


def test_the_policy_saves_every_other_mm_and_the_listed_ops():
    policy, x = op_policy(), torch.ones(2, 2)
    mms = [_decide(policy, aten.mm.default, x, x) for _ in range(5)]
    assert mms == [SAVE, RECOMPUTE, SAVE, RECOMPUTE, SAVE]
    flash = aten._scaled_dot_product_flash_attention.default
    assert _decide(policy, flash, x, x, x) is SAVE
    assert _decide(policy, aten.max.default, x) is SAVE
    cpu_attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    for op in (aten.addmm.default, aten.add.Tensor, cpu_attention, aten.silu.default):
        assert _decide(policy, op, x, x) is RECOMPUTE, op
    # a fresh policy per block call: its own count
    assert _decide(op_policy(), aten.mm.default, x, x) is SAVE
    # torch versions that ask again while recomputing get the forward's answers there
    again = [_decide(policy, aten.mm.default, x, x, recompute=True) for _ in range(3)]
    assert again == [SAVE, RECOMPUTE, SAVE]
    assert _decide(policy, aten._to_copy.default, x, device=torch.device("cpu")) is RECOMPUTE
    assert aten._scaled_dot_product_cudnn_attention.default in SAVE_LIST


def _layers_flags(mode: str, layers: int = 4) -> list[bool]:
    config = tiny_config("llama")
    config.num_hidden_layers = layers
    model = tf.LlamaForCausalLM(config).train()
    note = apply_checkpointing(model, mode, ())
    assert "activation_checkpointing_enable" in note
    return [layer.gradient_checkpointing for layer in model.model.layers]


@pytest.mark.parametrize(
    ("mode", "flags"),
    [
        ("non-reentrant", [True] * 5),
        ("selective:op", [True] * 5),
        ("selective:layer=1", [True] * 5),
        ("selective:layer=2", [False, True, False, True, False]),
        ("selective:layer=3", [False, False, True, False, False]),
        ("selective:layer=9", [False] * 5),
    ],
)
def test_transformers_layers_keep_torchtitans_rule(mode, flags):
    assert _layers_flags(mode, 5) == flags


def test_the_plain_modes_pass_the_same_kwargs_as_before():
    config = tiny_config("llama")
    model = tf.LlamaForCausalLM(config).train()
    apply_checkpointing(model, "non-reentrant", ())
    func = model.model.layers[0]._gradient_checkpointing_func
    assert func.keywords == {"use_reentrant": False}
    model = tf.LlamaForCausalLM(config).train()
    apply_checkpointing(model, "selective:op", ())
    func = model.model.layers[0]._gradient_checkpointing_func
    assert set(func.keywords) == {"use_reentrant", "context_fn"}
    assert func.keywords["use_reentrant"] is False


@pytest.mark.parametrize("mode", ["selective:op", "selective:layer=2"])
@pytest.mark.parametrize(
    "argv",
    [["tiny-hf"], ["--model", "sample_models.models:llama", "--world-size", "2"]],
    ids=["transformers-1-rank", "sample-2-ranks"],
)
def test_a_converted_model_trains_as_the_original_under_each_mode(tmp_path, mode, argv):
    if argv[0] == "tiny-hf":
        torch.manual_seed(0)
        tf.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path)
        argv = [str(tmp_path)]
    result = runner.invoke(app, ["verify", *argv, "--checkpointing", mode])
    assert result.exit_code == 0, result.output
    assert "OK: converted model matches the original" in " ".join(result.output.split())
