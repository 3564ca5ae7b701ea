"""The per-rank memory model against figures computed by hand.

The model below, ``tiny()``: a bf16 embedding (1024 elements) in the root unit, two
bf16 blocks of 4096 elements each (units ``layers.0``/``layers.1``), an fp32 norm
(64) in the root unit and a 32-element fp32 module buffer. With AdamW and master
weights (auto: on for bf16) a bf16 element costs 2 (param) + 2 (grad) + 4 (master)
+ 8 (two fp32 states) = 16 bytes, an fp32 element 4 + 4 + 8 = 16 bytes.
"""

from __future__ import annotations

import pytest

from yafsdp_cli import ModelSpec, TensorRecord, YafsdpError, plan
from yafsdp_cli.memory.estimate import MemoryConfig, assumptions, estimate_memory
from yafsdp_cli.options import LayoutOptions

BF16_NUMEL = 1024 + 2 * 4096  # 9216
FP32_NUMEL = 64


def tiny(**record_kw) -> ModelSpec:
    tensors = (
        TensorRecord("emb.weight", (16, 64), "bfloat16", **record_kw),
        TensorRecord("layers.0.mlp.w", (64, 64), "bfloat16", **record_kw),
        TensorRecord("layers.1.mlp.w", (64, 64), "bfloat16", **record_kw),
        TensorRecord("norm.weight", (64,), "float32", **record_kw),
        TensorRecord("rope", (32,), "float32", is_param=False, requires_grad=False),
    )
    return ModelSpec(
        tensors,
        has_architecture=False,
        units=("layers.0", "layers.1"),
        module_names=("emb", "layers", "layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp"),
    )


def report(world_size: int, align: str = "yafsdp", spec: ModelSpec | None = None, **cfg):
    spec = spec or tiny()
    layout = plan(spec, LayoutOptions(world_size=world_size, align=align))
    cfg.setdefault("round_bytes", 1)
    return estimate_memory(layout, MemoryConfig(**cfg))


def parts(m) -> tuple[int, ...]:
    return (m.params, m.grads, m.optimizer, m.master, m.buffers, m.gather, m.reduce)


def test_ddp_baseline_by_hand():
    ddp = report(2).baseline
    # params 2 * 9216 + 4 * 64; grads the same; master 4 * 9216;
    # AdamW 2 fp32 states for every element (bf16 ones through their master copy)
    assert parts(ddp) == (18688, 18688, 74240, 36864, 128, 0, 0)
    assert ddp.persistent == ddp.total == 148608


def test_flat_scheme_by_hand_at_world_size_2():
    r = report(2)
    flat = r.flat
    # each rank: half of every buffer (bf16 4608 elements, fp32 32)
    assert parts(flat)[:5] == (9344, 9344, 37120, 18432, 128)
    assert flat.persistent == 74368
    # largest unit: a block, 4096 bf16 = 8192 bytes; two gather + two gradient buffers
    assert (r.largest_unit, r.largest_unit_bytes) == ("layers.0", 8192)
    assert (flat.gather, flat.reduce) == (16384, 16384)
    assert flat.total == 107136
    assert r.savings_bytes == 148608 - 107136
    assert r.savings_percent == pytest.approx(100 * 41472 / 148608)


def test_references_by_hand_at_world_size_2():
    zero2, zero3, fsdp = report(2).references
    assert [m.scheme.inspect_key for m in (zero2, zero3, fsdp)] == ["zero2", "zero3", "fsdp"]
    # ZeRO-2: parameters whole, the rest halved
    assert parts(zero2) == (18688, 9344, 37120, 18432, 128, 0, 0)
    # ZeRO-3: everything halved; one gathered block and its gradients
    assert parts(zero3) == (9344, 9344, 37120, 18432, 128, 8192, 8192)
    # FSDP2: every parameter halves on dim 0; under mixed precision the shards are
    # float32 (4608 bf16 elements -> 18432 bytes, + 128 of the fp32 norm) and there is
    # no other copy; gathered: the root unit (emb 2048 + norm 256 bytes, kept through
    # the step) and two blocks (8192 each); one block's gradients reduce-scattered
    assert parts(fsdp) == (18560, 18560, 37120, 0, 128, 2304 + 16384, 8192)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 16])
def test_flat_persistent_bytes_divide_by_world_size(world_size):
    """Up to 8 ranks every buffer splits evenly (multiples of 8 * world size), so
    each rank holds exactly 1/N of the baseline's parameter bytes, plus the
    replicated module buffer. At 16 the fp32 norm (64) pads to 128: 4 more fp32
    elements per rank, 16 bytes each."""
    r = report(world_size)
    padding = 4 * 16 if world_size == 16 else 0
    assert r.flat.persistent == (148608 - 128) // world_size + 128 + padding
    gathered = 0 if world_size == 1 else 2 * 8192
    assert (r.flat.gather, r.flat.reduce) == (gathered, gathered)
    assert r.flat.total == r.flat.persistent + 2 * gathered


def test_world_size_one_equals_the_baseline_without_rounding():
    r = report(1)
    assert r.flat.total == r.baseline.total == 148608
    assert r.savings_bytes == 0


def test_padding_is_paid_per_rank():
    """yafsdp alignment at world size 3 pads each buffer to a multiple of 24."""
    r = report(3)
    # shards: emb 1024 -> 1032 / 3 = 344; blocks 4096 -> 4104 / 3 = 1368; norm 64 -> 72 / 3 = 24
    bf16_shard = 344 + 2 * 1368
    assert r.flat.params == 2 * bf16_shard + 4 * 24
    assert r.flat.optimizer == 8 * bf16_shard + 8 * 24
    # the gathered block is padded too: 4104 bf16 elements
    assert r.largest_unit_bytes == 4104 * 2


def test_allocator_rounding_favours_flat_buffers():
    """Ten 40-byte tensors: ten 512-byte blocks each per-parameter, one flat buffer."""
    spec = ModelSpec(
        tuple(TensorRecord(f"p{i}", (10,), "float32") for i in range(10)), has_architecture=False
    )
    r = report(1, spec=spec, round_bytes=512, optimizer="sgd")
    assert parts(r.baseline)[:4] == (5120, 5120, 5120, 0)
    # 100 elements padded to 104 (8-element shards) = 416 bytes -> one 512-byte block each
    assert parts(r.flat)[:4] == (512, 512, 512, 0)


def test_optimizer_master_and_grad_dtype_options():
    sgd = report(1, optimizer="sgd").baseline
    assert sgd.optimizer == 4 * BF16_NUMEL + 4 * FP32_NUMEL  # one fp32 momentum each
    assert report(1, optimizer="none").baseline.optimizer == 0
    off = report(1, master_weights=False).baseline
    assert off.master == 0
    assert off.optimizer == 2 * (2 * BF16_NUMEL) + 2 * (4 * FP32_NUMEL)  # states in bf16
    fp32_grads = report(1, grad_dtype="fp32").baseline
    assert fp32_grads.grads == 4 * (BF16_NUMEL + FP32_NUMEL)


def test_master_weights_forced_on_covers_fp32_too_only_when_needed():
    on = report(1, master_weights=True).baseline
    assert on.master == 4 * BF16_NUMEL  # fp32 parameters need no copy


def test_frozen_parameters_have_no_gradients_or_states():
    r = report(2, spec=tiny(requires_grad=False))
    assert (r.baseline.grads, r.baseline.optimizer, r.baseline.master) == (0, 0, 0)
    assert r.flat.reduce == 0 and r.flat.gather == 16384


def test_unconverted_parameters_stay_whole_in_the_flat_scheme():
    spec = tiny()
    layout = plan(spec, LayoutOptions(world_size=2, excludes=["name:emb.*"]))
    r = estimate_memory(layout, MemoryConfig(round_bytes=1))
    # emb: 1024 bf16 elements at 16 bytes each, whole on every rank
    assert r.flat.persistent == 74368 - 1024 * 16 // 2 + 1024 * 16


def test_bad_config_is_an_error():
    with pytest.raises(YafsdpError, match="--optimizer 'lamb' is not one of adamw"):
        MemoryConfig(optimizer="lamb")
    with pytest.raises(YafsdpError, match="unknown dtype 'fp12'"):
        MemoryConfig(grad_dtype="fp12")
    with pytest.raises(YafsdpError, match="--round-bytes must be at least 1"):
        MemoryConfig(round_bytes=0)


def test_assumptions_name_every_input():
    text = " ".join(assumptions(report(8, optimizer="sgd", round_bytes=512)))
    assert "rounded up to 512 bytes" in text
    assert "optimizer sgd: 1 state(s)" in text
    assert "master weights (auto)" in text
    assert "1/8 of every flat buffer" in text and "(layers.0)" in text
    assert "world size 1" in " ".join(assumptions(report(1)))
    assert "master weights: off" in " ".join(assumptions(report(1, master_weights=False)))


def test_flat_persistent_matches_a_converted_model_after_an_adamw_step():
    """World size 1, no rounding: the model's parameter, gradient and optimizer
    bytes are what a converted model really holds after one AdamW step."""
    import torch

    from tests.helpers import build
    from yafsdp_cli import convert_module, spec_from_module
    from yafsdp_cli.engine.inputs import make_input, projection_loss

    model = build("gpt")
    layout = plan(spec_from_module(model))
    flat = convert_module(model, layout)
    opt = torch.optim.AdamW(flat.parameters(), foreach=False)
    projection_loss(model(make_input(model))).backward()
    opt.step()
    bufs = [b.param for b in flat.buffers]
    held_params = sum(p.numel() * p.element_size() for p in bufs)
    held_grads = sum(p.grad.numel() * p.grad.element_size() for p in bufs)
    held_states = sum(
        v.numel() * v.element_size() for p in bufs for k, v in opt.state[p].items() if k != "step"
    )
    m = estimate_memory(layout, MemoryConfig(round_bytes=1)).flat
    assert (m.params, m.grads, m.optimizer, m.master) == (held_params, held_grads, held_states, 0)
