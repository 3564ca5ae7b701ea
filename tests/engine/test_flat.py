"""The conversion engine: exact training equivalence, tied weights, restore."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_records_equal, build, convert_copy, run_steps
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from yafsdp_cli import ConversionError, convert_module, plan, spec_from_module
from yafsdp_cli.engine.flat import HANDLE_ATTR
from yafsdp_cli.options import LayoutOptions


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_converted_training_equals_original(sample_name, optimizer):
    model = build(sample_name)
    twin, flat = convert_copy(model, world_size=4)
    ref = run_steps(model, optimizer=optimizer)
    got = run_steps(twin, flat, optimizer=optimizer)
    assert_records_equal(ref, got)
    flat.check_padding()


@pytest.mark.parametrize("filters", [["linear"], ["embedding", "norm"], ["name:*.weight"]])
def test_partial_conversion_equals_original(filters):
    model = build("llama")
    twin, flat = convert_copy(model, filters=filters, world_size=3, align="megatron")
    assert_records_equal(run_steps(model), run_steps(twin, flat))


def test_every_parameter_and_gradient_is_checked():
    """The comparison itself must notice a wrong gradient."""
    model = build("gpt")
    twin, flat = convert_copy(model)
    ref = run_steps(model, steps=1)
    got = run_steps(twin, flat, steps=1)
    got[0]["grads"]["lm_head.weight"] = got[0]["grads"]["lm_head.weight"] + 1e-3
    with pytest.raises(AssertionError, match="lm_head.weight"):
        assert_records_equal(ref, got)


def test_tied_weight_is_one_entry_and_stays_one_tensor():
    model = build("gpt")
    twin, flat = convert_copy(model)
    entries = {e.name: e for b in flat.layout.buffers for e in b.entries}
    assert "lm_head.weight" not in entries
    assert entries["transformer.wte.weight"].aliases == ("lm_head.weight",)
    run_steps(twin, flat, steps=2)
    wte, head = twin.transformer["wte"].weight, twin.lm_head.weight
    assert wte is head  # one view set on both owners
    restored = flat.restore()
    assert restored.lm_head.weight is restored.transformer["wte"].weight
    assert isinstance(restored.lm_head.weight, nn.Parameter)


def test_tied_gradient_is_the_sum_of_both_uses():
    model = build("gpt")
    twin, flat = convert_copy(model)
    ref = run_steps(model, steps=1, optimizer="none")
    got = run_steps(twin, flat, steps=1, optimizer="none")
    g_ref = ref[0]["grads"]["transformer.wte.weight"]
    assert torch.equal(got[0]["grads"]["lm_head.weight"], g_ref)
    assert torch.equal(got[0]["grads"]["transformer.wte.weight"], g_ref)


def test_restore_is_bit_exact_and_keeps_parameter_order(sample_name):
    model = build(sample_name)
    before = {
        n: (p.detach().clone(), p.requires_grad)
        for n, p in model.named_parameters(remove_duplicate=False)
    }
    sd_keys = list(model.state_dict())
    flat = convert_module(
        model,
        plan(
            spec_from_module(model),
            LayoutOptions(filters=["dtype:fp32"] if sample_name == "llama" else (), world_size=2),
        ),
    )
    restored = flat.restore()
    after = dict(restored.named_parameters(remove_duplicate=False))
    assert list(after) == list(before)
    assert list(restored.state_dict()) == sd_keys
    for name, (value, requires_grad) in before.items():
        assert torch.equal(after[name].detach(), value), name
        assert after[name].requires_grad == requires_grad
    assert HANDLE_ATTR not in restored.__dict__ and type(restored) is type(build(sample_name))
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in restored.parameters())


def test_accumulation_resets_on_zero_grad_and_adds_without_it():
    model = build("mlp")
    twin, flat = convert_copy(model)
    x = torch.randn(4, 64)
    twin(x).sum().backward()
    g1 = flat.grad("net.0.weight").clone()
    twin(x).sum().backward()
    assert torch.equal(flat.grad("net.0.weight"), g1 + g1)  # accumulated
    flat.zero_grad()
    assert flat.grad("net.0.weight") is None
    twin(x).sum().backward()
    assert torch.equal(flat.grad("net.0.weight"), g1)  # fresh step, not 3 * g1
    flat.zero_grad(set_to_none=False)
    twin(x).sum().backward()
    assert torch.equal(flat.grad("net.0.weight"), g1)


class _TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_unused_parameter_gets_zero_not_stale_gradient():
    ref, model = _TwoBranch(), None
    model = copy.deepcopy(ref)
    flat = convert_module(model, plan(spec_from_module(model)))
    assert len(flat.buffers) == 1  # a and b share one flat buffer
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert flat.grad("b.weight").any()
    flat.zero_grad()
    model(x, use_b=False).sum().backward()  # b unused this step
    ref(x, use_b=False).sum().backward()
    assert ref.b.weight.grad is None
    assert not flat.grad("b.weight").any()  # zero, not last step's value
    assert torch.equal(flat.grad("a.weight"), ref.a.weight.grad)
    flat.check_padding()


def test_frozen_parameters_get_their_own_buffer_and_no_gradient():
    model = build("mlp")
    model.net[0].weight.requires_grad_(False)
    twin, flat = convert_copy(model)
    names = [b.name for b in flat.layout.buffers]
    assert names == ["__flat__.float32.frozen", "__flat__.float32"]  # order of first entry
    twin(torch.randn(2, 64)).sum().backward()
    assert flat.grad("net.0.weight") is None
    assert flat.grad("net.2.weight") is not None
    assert not flat.restore().net[0].weight.requires_grad


def test_units_get_buffers_of_their_own():
    model = build("llama")
    twin, flat = convert_copy(model)
    units = {b.unit for b in flat.layout.buffers}
    assert units == {"", "model.layers.0", "model.layers.1"}
    # One buffer per (unit, dtype): the blocks hold bf16 matrices and fp32 norms.
    per_unit = {(b.unit, b.dtype) for b in flat.layout.buffers}
    assert ("model.layers.0", "bfloat16") in per_unit and ("model.layers.0", "float32") in per_unit
    assert len(per_unit) == len(flat.layout.buffers)


def test_shared_module_registered_twice_is_one_owner():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    ref = copy.deepcopy(model)
    flat = convert_module(model, plan(spec_from_module(model)))
    x = torch.randn(3, 4)
    ref(x).sum().backward()
    model(x).sum().backward()
    assert torch.equal(flat.grad("2.weight"), ref[0].weight.grad)
    restored = flat.restore()
    assert restored[0] is restored[2] and isinstance(restored[0].weight, nn.Parameter)


def test_converting_twice_and_mismatched_layouts_are_refused():
    model = build("mlp")
    layout = plan(spec_from_module(model))
    flat = convert_module(model, layout)
    with pytest.raises(ConversionError, match="converted already"):
        convert_module(model, layout)
    flat.restore()
    other = build("gpt")
    with pytest.raises(ConversionError, match="no parameter"):
        convert_module(other, layout)
    untied = build("gpt")
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(ConversionError, match="ties it to"):
        convert_module(untied, plan(spec_from_module(build("gpt"))))


def test_converted_model_runs_on_meta_device():
    with torch.device("meta"):
        model = build("llama")
    flat = convert_module(model, plan(spec_from_module(model), LayoutOptions(world_size=8)))
    assert all(p.device.type == "meta" for p in model.parameters())
    out = model(torch.zeros(1, 8, dtype=torch.long, device="meta"))
    assert out.shape == (1, 8, 256)
    assert flat.layout.buffers[0].padded_numel % 64 == 0


class _Bag(nn.Module):
    """Parameters of arbitrary shapes and dtypes, in two blocks and a root."""

    def __init__(self, specs):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        self.owners = []
        for i, (shape, dtype, where) in enumerate(specs):
            owner = self if where == 2 else self.blocks[where]
            p = nn.Parameter(torch.randn(shape, dtype=torch.float64).to(getattr(torch, dtype)))
            owner.register_parameter(f"p{i}", p)
            self.owners.append((owner, f"p{i}"))

    def forward(self, scale):
        total = scale.sum() * 0
        for i, (owner, attr) in enumerate(self.owners):
            w = getattr(owner, attr)
            total = total + (w.double() * (i + 1) * scale).sum()
        return total


_param_specs = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), max_size=3).map(tuple),
        st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(
    _param_specs, st.integers(1, 9), st.sampled_from(["yafsdp", "fsdp", "megatron", "none", "8"])
)
def test_random_modules_convert_train_and_restore_exactly(specs, world_size, align):
    torch.manual_seed(0)
    model = _Bag(specs)
    ref = copy.deepcopy(model)
    flat = convert_module(
        model, plan(spec_from_module(model), LayoutOptions(world_size=world_size, align=align))
    )
    for b in flat.buffers:
        assert b.param.numel() % world_size == 0
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, foreach=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=False)
    scale = torch.tensor(1.5, dtype=torch.float64)
    for _ in range(2):  # two steps, two accumulated backwards each
        for _ in range(2):
            ref(scale).backward()
            model(scale).backward()
        grads = flat.named_grads()
        for name, p in ref.named_parameters():
            assert (p.grad is None) == (grads[name] is None), name
            if p.grad is not None:
                assert torch.equal(grads[name], p.grad), name
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        flat.check_padding()
    restored = flat.restore()
    for (name, a), (_, b) in zip(ref.named_parameters(), restored.named_parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
