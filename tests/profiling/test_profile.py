"""`yafsdp profile`: categories, fake against real, sharded persistent bytes, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build, options
from typer.testing import CliRunner

from yafsdp_cli import convert_module, plan, spec_from_module
from yafsdp_cli.cli import app
from yafsdp_cli.engine.train_step import make_batch, step_loss
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.profiling import CATEGORIES, ProfileOptions, StorageTracker, profile_model
from yafsdp_cli.sources import load_source

runner = CliRunner()


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def profile(name, **kw):
    return profile_model(loaded(name), options(ProfileOptions, **kw))


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fake_equals_real_on_every_sample_model(sample_name, world_size):
    real = profile(sample_name, world_size=world_size)
    fake = profile(sample_name, world_size=world_size, fake=True)
    for a, b in ((real.original, fake.original), (real.converted_step, fake.converted_step)):
        assert a.peak == b.peak, a.variant
        assert a.phase_peaks == b.phase_peaks
        assert a.end == b.end
        assert a.peak_phase == b.peak_phase
    assert real.converted_step.peak.total > 0


def test_categories_sum_to_the_peak_and_match_the_model_after_the_step():
    """The end-of-step figures, checked against the module itself: parameters and
    AdamW state (two per element plus a 4-byte step counter per tensor)."""
    r = profile("gpt", optimizer="adamw", optimizer_impl="for-loop")
    model = build("gpt")
    params = list(model.parameters())  # tied once
    for step in (r.original, r.converted_step):
        assert sum(getattr(step.peak, c) for c in CATEGORIES) == step.peak.total
        assert step.peak.total == max(step.phase_peaks.values())
        assert step.end.gradients == step.end.temporaries == 0
        assert step.end.activations == 2 * 16 * 8  # the input batch: (2, 16) int64
    assert r.original.end.parameters == nbytes(params)
    assert r.original.end.optimizer == 2 * nbytes(params) + 4 * len(params)
    layout = plan(spec_from_module(model))
    flat_bytes = sum(b.nbytes for b in layout.buffers)
    assert r.converted_step.end.parameters == flat_bytes
    assert r.converted_step.end.optimizer == 2 * flat_bytes + 4 * len(layout.buffers)


def test_sharded_persistent_part_is_per_rank():
    """At world size 4 the converted step starts and ends with shards only."""
    r = profile("llama", world_size=4, optimizer="adamw")
    layout = plan(spec_from_module(build("llama")), LayoutOptions(world_size=4))
    shard_bytes = sum(b.nbytes // 4 for b in layout.buffers)
    end = r.converted_step.end
    assert end.parameters == shard_bytes
    assert end.optimizer == 2 * shard_bytes + 4 * len(layout.buffers)  # bf16/fp32 states
    assert end.buffers == 32  # the rotary table stays whole
    assert r.world_size == 4 and "rank 0 of 4" in r.notes[-1]


@pytest.mark.parametrize("world_size", [4, 8])
def test_converted_peak_not_above_the_original_when_sharded(sample_name, world_size):
    """At world size 1 (and 2 for the CNN, whose one root buffer stays gathered) the
    converted peak is higher on these tiny models; see docs/profile.md."""
    r = profile(sample_name, world_size=world_size)
    assert r.converted_step.peak.total <= r.original.peak.total
    assert r.saving_bytes == r.original.peak.total - r.converted_step.peak.total


def test_flat_gradient_buffer_counts_as_gradients():
    model = build("mlp")
    flat = convert_module(model, plan(spec_from_module(model)))
    tracker = StorageTracker()
    tracker.assign(list(model.parameters()), "parameters")
    batch = make_batch(model)
    with tracker:
        tracker.set_phase("forward")
        loss = step_loss(model(*batch.args), 0)
        tracker.set_phase("backward")
        loss.backward()
        grad = flat.buffers[0].param.grad
        tracker.assign([grad], "gradients")
    assert tracker.category_of(grad) == "gradients"
    assert tracker.category_of(flat.buffers[0].param) == "parameters"
    timeline = tracker.replay()
    assert timeline.end.gradients == grad.numel() * 4


def test_flat_gradient_is_written_as_soon_as_it_exists():
    """Regression (flat.py): views made before the whole forward had their backward
    run last, so every parameter's gradient waited until the end of backward."""
    model = build("mlp")
    flat = convert_module(model, plan(spec_from_module(model)))
    seen = {}

    def written(_grad) -> None:
        seen.setdefault("written", flat.buffers[0].param.grad is not None)

    def watch(_module, _inputs, out) -> None:
        out.register_hook(written)

    h = model.net[0].register_forward_hook(watch)
    step_loss(model(make_batch(model).args[0]), 0).backward()
    h.remove()
    # the grad w.r.t. the first layer's output comes late in backward: by then the
    # last layers' gradients must already sit in the flat buffer
    assert seen["written"] is True


def test_per_module_rows_follow_the_model():
    r = profile("llama", per_module=True, depth=3)
    names = [m.name for m in r.original.modules]
    assert names[:3] == ["model", "model.embed_tokens", "model.layers.0"]
    assert "lm_head" in names
    layer = next(m for m in r.original.modules if m.name == "model.layers.1")
    assert 0 < layer.saved <= layer.forward_peak <= r.original.peak.total
    assert [m.name for m in r.converted_step.modules] == names


def test_profile_cli_json_is_one_document():
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:moe", "--world-size", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "yafsdp.profile/1"
    assert doc["world_size"] == 2
    for variant in ("original", "converted"):
        peak = doc[variant]["peak"]
        assert sum(peak.values()) == doc[variant]["peak_bytes"]
    assert doc["saving_bytes"] == doc["original"]["peak_bytes"] - doc["converted"]["peak_bytes"]


def test_profile_cli_table_and_fake():
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:cnn", "--fake", "--per-module"]
    )
    assert result.exit_code == 0, result.output
    assert "fake tensors" in result.output and "Per module" in result.output
    assert "features.0" in result.output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profile", "sample_models/gpt.safetensors"], "needs its architecture"),
        (["profile", "--model", "sample_models.models:gpt", "--optimizer", "lion"], "lion"),
        (["profile", "--model", "sample_models.models:gpt", "--optimizer-impl", "x"], "auto"),
        (["profile", "--model", "sample_models.models:gpt", "--device", "tpu"], "cpu or cuda"),
        (["profile", "--model", "sample_models.models:gpt", "--filter", "conv"], "conv"),
        (["profile", "--model", "sample_models.models:cnn", "--input-shape", "2,a"], "2,a"),
    ],
)
def test_profile_bad_input_is_one_line_and_exit_2(argv, message):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_profile_cuda_without_a_gpu_says_so():
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:mlp", "--device", "cuda"]
    )
    assert result.exit_code == 2
    assert "no CUDA device" in result.output


def test_unwritten_gradient_regions_read_as_zeros():
    """Regression (flat.py): the flat gradient is allocated uninitialized and what no
    gradient reached (padding, an unused entry) is zeroed when backward ends."""
    model = build("mlp")
    flat = convert_module(model, plan(spec_from_module(model), LayoutOptions(world_size=3)))
    x = make_batch(model).args[0]
    # net.0 is skipped: its entries get no gradient in this backward
    step_loss(model.net[2:](torch.nn.functional.gelu(x @ torch.ones(64, 128))), 0).backward()
    assert not flat.grad("net.0.weight").any() and not flat.grad("net.0.bias").any()
    assert flat.grad("net.4.weight").abs().sum() > 0
    flat.check_padding()  # raises if padding of the gradient is not zero


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"world_size": 4, "target": "cuda", "checkpointing": "non-reentrant"},
        {"world_size": 2, "checkpointing": "reentrant", "param_dtype": "bf16"},
    ],
)
def test_phase_peaks_alone_equal_the_replays(sample_name, kw):
    """The lean pass a plan takes per cell gives the full replay's phase peaks and
    breakdowns."""
    from yafsdp_cli.profiling.profiler import profile_converted

    if sample_name in ("mlp", "cnn"):  # no repeated blocks to checkpoint
        kw = {k: v for k, v in kw.items() if k != "checkpointing"}
    steps: dict = {}
    profile_converted(loaded(sample_name), options(ProfileOptions, fake=True, **kw), steps=steps)
    events = steps["converted"].events
    timeline = events.replay()
    assert events.phase_peaks() == (
        timeline.phase_peaks,
        timeline.phase_breakdowns,
        timeline.phase_micro_batches,
    )
    assert set(timeline.phase_peaks) == {"forward", "backward", "optimizer"}
