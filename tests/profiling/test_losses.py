"""``--loss``: each loss's real step equals its fake step to the byte; the chunked and
fused cross-entropies compute ``F.cross_entropy``'s value and gradients; the default
follows the model; bad values and models a loss cannot take are one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.engine.losses import _ChunkedLinearCE, _FusedCE, parse_loss
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
LOSSES = ("model", "ce", "fused-ce", "chunked-ce", "chunked-ce:3", "projection")
NARROW = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2)


def folder(tmp_path, name: str, **extra):
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=500, num_hidden_layers=2, num_key_value_heads=1, **NARROW, **extra
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif name == "gpt2":  # tied head
        cfg = tf.GPT2Config(vocab_size=500, n_layer=2, n_embd=16, n_head=2, n_positions=64)
        cfg.architectures = ["GPT2LMHeadModel"]
    else:
        cfg = tf.T5Config(vocab_size=500, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8)
        cfg.architectures = ["T5ForConditionalGeneration"]
    path = tmp_path / name
    cfg.save_pretrained(path)
    return path


def profiled(path, fake: bool, **kw):
    return profile_model(load_source(path), options(ProfileOptions, fake=fake, **kw))


@pytest.mark.parametrize(
    ("name", "loss", "world_size"),
    [
        *(("llama", loss, ws) for loss, ws in zip(LOSSES, (1, 2, 1, 2, 1, 2))),
        ("gpt2", "fused-ce", 1),
        ("gpt2", "chunked-ce", 2),  # the head tied to the embedding
        ("gpt2", "model", 1),
        ("t5", "model", 2),  # labels from the decoder's input ids
        ("t5", "ce", 1),
    ],
)
def test_real_step_equals_fake_step(tmp_path, name, loss, world_size):
    path = folder(tmp_path, name)
    kw = dict(batch=2, seq_len=32, loss=loss, world_size=world_size)
    real, fake = profiled(path, False, **kw), profiled(path, True, **kw)
    for a, b in ((real.original, fake.original), (real.converted_step, fake.converted_step)):
        assert a.peak == b.peak, a.variant
        assert a.phase_peaks == b.phase_peaks, a.variant
        assert a.end == b.end, a.variant
    assert real.loss == parse_loss(loss).name


def test_each_loss_holds_what_it_says(tmp_path):
    """At a vocabulary 30x the hidden size the loss region decides the peak: the
    float32 cross-entropy holds the most, the fused kernel less, 8 chunks least, and
    fewer chunks more than more."""
    path = folder(tmp_path, "llama")
    peak = {
        loss: profiled(path, True, batch=2, seq_len=64, loss=loss).original.peak.total
        for loss in ("ce", "fused-ce", "chunked-ce", "chunked-ce:2")
    }
    assert peak["chunked-ce"] < peak["fused-ce"] < peak["ce"]
    assert peak["chunked-ce"] < peak["chunked-ce:2"]


def test_default_is_the_models_own_loss_where_it_has_one(tmp_path):
    path = folder(tmp_path, "llama")
    report = profiled(path, True, batch=2, seq_len=16)
    assert report.loss == "model"
    model = profiled(path, True, batch=2, seq_len=16, loss="model")
    assert report.original.peak == model.original.peak
    mlp = profile_model(
        load_source(None, model="sample_models.models:mlp"), options(ProfileOptions, fake=True)
    )
    assert mlp.loss == "projection"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_and_fused_losses_compute_cross_entropy(dtype):
    torch.manual_seed(0)
    h = torch.randn(2, 37, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(101, 16, dtype=dtype, requires_grad=True)
    b = torch.randn(101, dtype=dtype, requires_grad=True)
    t = torch.randint(0, 101, (2, 37))
    want = F.cross_entropy(F.linear(h, w, b).flatten(0, 1).to(torch.float64), t.flatten())
    want_grads = torch.autograd.grad(want, (h, w, b))
    for got in (_ChunkedLinearCE.apply(h, w, b, t, 5), _FusedCE.apply(F.linear(h, w, b), t)):
        grads = torch.autograd.grad(got, (h, w, b))
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        for g, wg in zip(grads, want_grads):
            torch.testing.assert_close(g, wg.to(dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("focal", "is not one of"),
        ("chunked-ce:0", "from 1 to"),
        ("chunked-ce:x", "from 1 to"),
        ("ce:4", "only chunked-ce takes a count"),
    ],
)
def test_bad_loss_is_one_line(value, says):
    with pytest.raises(YafsdpError, match=says):
        parse_loss(value)
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:mlp", "--fake", "--loss", value]
    )
    assert result.exit_code == 2
    assert says in result.output and len(result.output.strip().splitlines()) == 1


def test_a_model_without_a_loss_refuses_model_and_chunked_losses():
    for loss, says in (("model", "computes no loss"), ("chunked-ce", "no linear output head")):
        result = runner.invoke(
            app, ["profile", "--model", "sample_models.models:mlp", "--fake", "--loss", loss]
        )
        assert result.exit_code == 2, result.output
        assert says in result.output


def test_chunked_loss_refuses_logits_changed_after_the_head(tmp_path):
    cfg = tf.Gemma2Config(
        vocab_size=500, num_hidden_layers=2, num_key_value_heads=1, head_dim=8, **NARROW
    )
    cfg.architectures = ["Gemma2ForCausalLM"]
    cfg.save_pretrained(tmp_path / "gemma2")
    result = runner.invoke(
        app, ["profile", str(tmp_path / "gemma2"), "--fake", "--loss", "chunked-ce"]
    )
    assert result.exit_code == 2
    assert "final_logit_softcapping" in result.output


def test_plan_names_the_loss(tmp_path):
    path = folder(tmp_path, "llama")
    args = ["plan", str(path), "--gpu-memory", "1GiB", "--seq-len", "64", "--world-size", "1,2"]
    shown = runner.invoke(app, [*args, "--loss", "chunked-ce:4"])
    assert shown.exit_code == 0, shown.output
    assert "loss chunked-ce:4" in " ".join(shown.output.split())
    doc = json.loads(runner.invoke(app, [*args, "--json"]).output)
    assert doc["loss"] == "model"
    chunked = json.loads(runner.invoke(app, [*args, "--loss", "chunked-ce:4", "--json"]).output)
    assert chunked["loss"] == "chunked-ce:4"
    assert "4 chunks of" in chunked["loss_detail"] and "x 500 logits" in chunked["loss_detail"]
