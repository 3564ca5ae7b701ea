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
from helpers import options
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
from yafsdp_cli.profiling import ProfileOptions, profiler
from yafsdp_cli.profiling.periodic import canonical
from yafsdp_cli.profiling.profiler import profile_converted, profile_model, warm_up
from yafsdp_cli.profiling.timeline import PHASE, SIZE
from yafsdp_cli.profiling.tracker import StorageTracker
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")
from hf_models import VOCAB  # noqa: E402 - after the skip

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
BATCH, SEQ = 2, 64


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
    # the projection: the loss the real step below takes
    argv = ["profile", path, "--checkpointing", mode, "--batch", str(BATCH), "--loss", "projection"]
    result = runner.invoke(app, [*argv, "--seq-len", str(SEQ), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [
        ("selective:op", "float32"),
        ("selective:op", "bfloat16"),
        ("selective:layer=2", "float32"),
        ("selective:layer=3", "float32"),
    ],
)
def test_profile_equals_a_real_step_checkpointed_by_torch(tmp_path, mode, dtype):
    path = _llama(tmp_path, dtype=dtype)
    truth = _truth(path, mode)
    for extra in ((), ("--fake", "--trace", "whole"), ("--fake",)):
        doc = _profile(path, mode, *extra)
        assert doc["checkpointing"] == mode
        step = doc["original"]
        assert step["peak_bytes"] == truth["peak"].total, extra
        assert step["peak"] == dataclasses.asdict(truth["peak"]), extra
        assert step["phase_peaks"] == truth["phase_peaks"], extra
    assert any("activation_checkpointing_enable" in n for n in doc["notes"])


def _report(path: str, mode: str, **kw):
    return profile_model(
        load_source(path),
        options(
            ProfileOptions, batch=BATCH, seq_len=SEQ, checkpointing=mode, loss="projection", **kw
        ),
    )


def _figures(step) -> tuple:
    return step.peak, step.phase_peaks, step.phase_breakdowns, step.end, step.peak_phase


@pytest.mark.parametrize(
    "kw",
    [{}, {"fake": True, "world_size": 2}, {"fake": True, "target": "cuda", "param_dtype": "bf16"}],
    ids=["real", "fake-2-ranks", "fake-cuda-bf16"],
)
def test_selective_op_lies_between_none_and_full_and_layer_1_is_full(tmp_path, kw):
    path = _llama(tmp_path)
    none, full = _report(path, "none", **kw), _report(path, "non-reentrant", **kw)
    op, layer1 = _report(path, "selective:op", **kw), _report(path, "selective:layer=1", **kw)
    for v in ("original", "converted_step"):
        peaks = [getattr(r, v).peak.total for r in (full, op, none)]
        assert peaks[0] < peaks[1] < peaks[2], (v, peaks)
        assert _figures(getattr(layer1, v)) == _figures(getattr(full, v)), v
        assert getattr(layer1, v).ops == getattr(full, v).ops, v


def _sizes(step) -> list:
    """Every allocation, free and phase of a recorded step, its blocks numbered in
    the order they are first sized (module and layer marks left out: a whole trace
    does not follow layers)."""
    return [e for e in canonical(step)[0] if e[0] in (SIZE, PHASE)]


def _periodic_and_whole(path: str, mode: str, **kw):
    out = []
    for periodic in (True, False):
        opts = options(ProfileOptions, fake=True, batch=BATCH, seq_len=16, checkpointing=mode, **kw)
        opts = dataclasses.replace(opts, periodic=periodic)
        steps: dict = {}
        converted = profile_converted(load_source(path), opts, steps=steps)
        report = profile_model(load_source(path), opts)
        out.append((report, converted, steps))
    return out


@pytest.mark.parametrize(
    ("layers", "mode", "kw"),
    [
        (8, "selective:op", {}),
        (8, "selective:op", {"target": "cuda", "world_size": 2}),
        (16, "selective:layer=2", {}),
        (16, "selective:layer=2", {"target": "cuda", "world_size": 4}),
    ],
)
def test_periodic_trace_equals_the_whole_trace(tmp_path, layers, mode, kw):
    (p_report, p_conv, p_steps), (w_report, w_conv, w_steps) = _periodic_and_whole(
        _llama(tmp_path, layers), mode, **kw
    )
    assert p_steps["trace"].periodic, p_steps["trace"].why
    assert not w_steps["trace"].periodic
    if mode == "selective:layer=2":
        assert "a period of 2 (every 2nd block checkpointed)" in p_steps["trace"].why
    assert _sizes(p_steps["converted"]) == _sizes(w_steps["converted"])
    assert p_steps["converted"].events.ops == w_steps["converted"].events.ops
    assert _figures(p_conv) == _figures(w_conv)
    for v in ("original", "converted_step"):
        a, b = getattr(p_report, v), getattr(w_report, v)
        assert _figures(a) == _figures(b), v
        assert a.ops == b.ops, v
    assert p_report.trace.periodic and not w_report.trace.periodic


def test_a_layer_period_too_long_to_gain_is_traced_whole_and_says_why(tmp_path):
    report = _report(_llama(tmp_path, 16), "selective:layer=3", fake=True)
    assert not report.trace.periodic
    assert report.trace.why == (
        "16 layers of model.layers, a period of 3 (every 3rd block checkpointed): tracing "
        "10 and 13 layers would cost more than the whole"
    )


def test_a_period_that_ignored_the_layer_rule_would_be_caught(tmp_path, monkeypatch):
    """Were the stack's period not widened to N, the repeated step would differ from
    the one traced a period deeper: the check catches it and the whole is traced."""
    path = _llama(tmp_path, 16)
    right = _report(path, "selective:layer=2", fake=True)
    monkeypatch.setattr(profiler, "layer_period", lambda mode: 1)
    wrong = _report(path, "selective:layer=2", fake=True)
    assert right.trace.periodic
    assert not wrong.trace.periodic
    assert "is not the traced step of 4" in wrong.trace.why
    assert _figures(wrong.original) == _figures(right.original)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("selective:layer=0", "--checkpointing 'selective:layer=0': N in selective:layer=N"),
        ("selective:layer=x", "--checkpointing 'selective:layer=x': N in selective:layer=N"),
        ("selective:foo", "--checkpointing 'selective:foo' is not one of none|reentrant|"),
    ],
)
def test_bad_modes_are_one_line_errors(mode, message):
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:llama", "--checkpointing", mode]
    )
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert message in " ".join(text.split())
    assert "Traceback" not in text and len(text.splitlines()) <= 3  # one line, as wrapped


@pytest.mark.parametrize("mode", ["selective:op", "selective:layer=2"])
def test_a_model_of_units_is_checkpointed_by_its_units(mode):
    """A model without transformers' enable: torch.utils.checkpoint around its units,
    fake equal to real, fewer bytes than none, more than every unit checkpointed."""

    def run(ck, **kw):
        loaded = load_source("sample_models/llama.safetensors", model="sample_models.models:llama")
        return profile_model(
            loaded, options(ProfileOptions, batch=1, seq_len=64, checkpointing=ck, **kw)
        )

    real, fake = run(mode), run(mode, fake=True)
    for v in ("original", "converted_step"):
        assert _figures(getattr(real, v)) == _figures(getattr(fake, v)), v
    peaks = [run(ck).original.peak.total for ck in ("non-reentrant", mode, "none")]
    assert peaks[0] < peaks[1] < peaks[2], peaks
    assert any("torch.utils.checkpoint" in n for n in real.notes)
