"""``--checkpointing selective:op`` and ``selective:layer=N`` against a real step.

The truth: a transformers Llama trained for one real step (no fake tensors) with its
decoder layers checkpointed here, by ``torch.utils.checkpoint.checkpoint`` itself
(non-reentrant; for ``selective:op`` with ``context_fn`` making
``create_selective_checkpoint_contexts`` of the policy ``engine.selective.op_policy``),
tracked by the project's ``StorageTracker``. ``yafsdp profile`` of the same model
and step, real and ``--fake``, gives the same peak, phase peaks and breakdown to the
byte: it reaches its checkpointing through transformers' own enable path, so the
equality says that path checkpoints what torch's API does. The ordering tests then
put the modes where they belong: ``selective:op`` between none and full,
``selective:layer=1`` equal to ``non-reentrant``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine.selective import op_policy
from yafsdp_cli.engine.train_step import (
    make_batch,
    make_optimizer,
    optimizer_tensors,
    run_forward,
    step_loss,
)
from yafsdp_cli.options import StepOptions
from yafsdp_cli.profiling.profiler import warm_up
from yafsdp_cli.profiling.tracker import StorageTracker
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")
from hf_models import VOCAB  # noqa: E402 - after the skip

pytestmark = pytest.mark.hf
runner = CliRunner()
BATCH, SEQ = 2, 64


@pytest.fixture(autouse=True)
def one_thread():
    """Figures are op outputs, whatever the threads; one keeps a shared machine quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _llama(tmp_path, layers: int = 4, dtype: str = "float32") -> str:
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    path = tmp_path / f"llama-{layers}-{dtype}"
    cfg.save_pretrained(path)
    return str(path)


def _checkpoint_layer(layer, selective: bool) -> None:
    """torch's API around one decoder layer's forward, as a training script writes it."""
    inner = layer.forward
    context = {"context_fn": lambda: create_selective_checkpoint_contexts(op_policy())}

    def forward(*args, **kwargs):
        extra = context if selective else {}
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    layer.forward = forward


def _truth(path: str, mode: str) -> dict:
    """One real tracked step of the model at ``path``, its layers checkpointed here:
    every one with the selective policy (``selective:op``), or the N-th, 2N-th, ...
    counted from 1 (``selective:layer=N``, torchtitan's rule)."""
    torch.manual_seed(0)
    model = load_source(path).build_module().train()
    layers = list(model.model.layers)
    if mode == "selective:op":
        for layer in layers:
            _checkpoint_layer(layer, selective=True)
    else:
        every = int(mode.rpartition("=")[2])
        for k, layer in enumerate(layers, 1):
            if k % every == 0:
                _checkpoint_layer(layer, selective=False)
    batch = make_batch(model, StepOptions(batch=BATCH, seq_len=SEQ))
    params = list(model.parameters())
    opt = make_optimizer("adamw", params, "auto")
    warm_up(opt, params)
    tracker = StorageTracker()
    tracker.assign(params, "parameters")
    tracker.assign(list(model.buffers()), "buffers")
    tracker.assign(optimizer_tensors(opt), "optimizer")
    tracker.assign(batch.tensors(), "activations")
    with tracker:
        tracker.set_phase("forward")
        torch.manual_seed(0)
        loss = step_loss(run_forward(model, batch), 0)
        tracker.set_phase("backward")
        loss.backward()
        del loss
        tracker.assign([p.grad for p in params if p.grad is not None], "gradients")
        tracker.set_phase("optimizer")
        opt.step()
        tracker.assign(optimizer_tensors(opt), "optimizer")
        for p in params:
            p.grad = None
    timeline = tracker.replay()
    return {"peak": timeline.peak, "phase_peaks": timeline.phase_peaks}


def _profile(path: str, mode: str, *extra: str) -> dict:
    argv = ["profile", path, "--checkpointing", mode, "--batch", str(BATCH)]
    result = runner.invoke(app, [*argv, "--seq-len", str(SEQ), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("mode", ["selective:op", "selective:layer=2", "selective:layer=3"])
def test_profile_equals_a_real_step_checkpointed_by_torch(tmp_path, mode):
    path = _llama(tmp_path)
    truth = _truth(path, mode)
    for extra in ((), ("--fake", "--trace", "whole"), ("--fake",)):
        doc = _profile(path, mode, *extra)
        assert doc["checkpointing"] == mode
        step = doc["original"]
        assert step["peak_bytes"] == truth["peak"].total, extra
        assert step["peak"] == dataclasses.asdict(truth["peak"]), extra
        assert step["phase_peaks"] == truth["phase_peaks"], extra
    assert any("activation_checkpointing_enable" in n for n in doc["notes"])
