"""The kernels of a step under the selective checkpointing modes, as the step-time
model counts them: what is recomputed in backward is marked ``recompute``, what the
selective policy saved is not run again, the count written from a few layers of
the stack equals the count of the whole model, and the recompute is timed."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import options

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.options import LayoutOptions, StepOptions
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import estimate_step, gpu_spec
from yafsdp_cli.timing.roofline import efficiency_for, op_time
from yafsdp_cli.timing.step_costs import count_step

tf = pytest.importorskip("transformers")

MM = "aten.mm.default"
FLASH = "aten._scaled_dot_product_flash_attention.default"


def _llama(tmp_path, layers: int) -> str:
    config = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    folder = tmp_path / f"llama-{layers}"
    config.save_pretrained(folder)
    return str(folder)


def _count(path: str, mode: str, periodic: bool = False, **step):
    opts = ProfileOptions(
        step=options(
            StepOptions,
            **{"batch": 2, "seq_len": 16, "target": "cuda", "checkpointing": mode, **step},
        ),
        fake=True,
    )
    return count_step(load_source(path), opts, periodic=periodic)


def _recomputed(costs, name: str | None = None) -> list:
    return [c for c in costs.ops if c.recompute and (name is None or c.name == name)]


def test_selective_op_recomputes_every_second_mm_and_not_attention(tmp_path):
    """bfloat16 on CUDA: sdpa is flash, which the policy saves; of each layer's mms the
    2nd, 4th, ... are recomputed, the others saved."""
    path, layers = _llama(tmp_path, 4), 4
    full = _count(path, "non-reentrant", param_dtype="bf16")
    op = _count(path, "selective:op", param_dtype="bf16")
    per_layer = len(_recomputed(full, MM)) // layers  # every mm of a layer's forward
    assert per_layer * layers == len(_recomputed(full, MM)) and per_layer > 2
    assert len(_recomputed(op, MM)) == layers * (per_layer // 2)
    assert len(_recomputed(full, FLASH)) == layers
    assert _recomputed(op, FLASH) == []
    assert 0 < op.phase("backward").recompute_flops < full.phase("backward").recompute_flops
    # what the forward and the backward proper run is the same under every mode
    for phase in ("forward", "optimizer"):
        assert op.phase(phase) == full.phase(phase)
    assert op.model_flops == full.model_flops


def test_selective_layer_recomputes_the_checkpointed_layers_only(tmp_path):
    path = _llama(tmp_path, 4)
    full, none = _count(path, "non-reentrant"), _count(path, "none")
    half = _count(path, "selective:layer=2")
    assert _recomputed(none) == []
    assert len(_recomputed(half)) * 2 == len(_recomputed(full))
    assert half.phase("backward").recompute_flops * 2 == full.phase("backward").recompute_flops
    one = _count(path, "selective:layer=1")
    assert dataclasses.replace(one, checkpointing="non-reentrant") == full


@pytest.mark.parametrize(
    ("layers", "mode", "depths"),
    [(16, "selective:op", "3, 4, 5 of 16"), (26, "selective:layer=2", "6, 8, 10 of 26")],
)
def test_periodic_count_equals_the_whole_count(tmp_path, layers, mode, depths):
    path = _llama(tmp_path, layers)
    periodic, whole = _count(path, mode, periodic=True), _count(path, mode)
    assert periodic.counted.startswith(f"{depths} layers"), periodic.counted
    assert dataclasses.replace(periodic, counted="") == whole
    assert _recomputed(whole)


def test_the_recompute_is_timed_in_the_backward(tmp_path):
    """Each mode's backward is the plain backward plus its recomputed kernels on the
    roofline: full recompute costs the most, selective:op less, every second layer
    less again."""
    path = _llama(tmp_path, 4)
    gpu = gpu_spec("h100-sxm")
    eff = efficiency_for(gpu)
    backward, recomputed = {}, {}
    for mode in ("none", "selective:layer=2", "selective:op", "non-reentrant"):
        costs = _count(path, mode, param_dtype="bf16")
        layout = plan(load_source(path).spec, LayoutOptions(world_size=1))
        backward[mode] = estimate_step(costs, layout, gpu).backward_s
        recomputed[mode] = sum(op_time(o, gpu, eff)[0] for o in _recomputed(costs))
    for mode, seconds in backward.items():
        assert seconds == pytest.approx(backward["none"] + recomputed[mode], rel=1e-9)
    order = [backward[m] for m in ("none", "selective:layer=2", "selective:op", "non-reentrant")]
    assert order == sorted(order) and len(set(order)) == 4
