"""verify's optimizer with its state on disk between parameters (verify/offload.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import options
from torch import nn

from yafsdp_cli.engine.train_step import make_optimizer
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import VerifyOptions, verify_model
from yafsdp_cli.verify import single as verify_single
from yafsdp_cli.verify.offload import OffloadedOptimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 2))
    return model.to(torch.bfloat16) if seed % 2 else model


def _train(model: nn.Module, opt, step_kwargs, steps: int = 4) -> None:
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(4, 7, dtype=dtype)
        # step 1 skips the last layer: it has no gradient there, and the optimizer
        # must leave it (and its state) alone
        body = model[:-1] if step == 1 else model
        body(x).float().pow(2).sum().backward()
        opt.step(**step_kwargs(step))
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_updates_as_one_optimizer_over_all_parameters(tmp_path, kind, seed):
    one, streamed = _model(seed), _model(seed)
    _train(one, make_optimizer(kind, one.parameters()), lambda s: {})
    opt = OffloadedOptimizer(kind, streamed.parameters(), tmp_path, "t")
    _train(streamed, opt, lambda s: {"last": s == 3})
    for (name, a), (_, b) in zip(one.named_parameters(), streamed.named_parameters()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.iterdir())  # the last step keeps nothing


def test_between_steps_no_state_is_in_memory_and_each_step_holds_one(tmp_path, monkeypatch):
    model = _model(0)
    opt = OffloadedOptimizer("adamw", model.parameters(), tmp_path, "t")
    resident = []
    real = torch.optim.AdamW.step

    def step(self, *a, **k):
        resident.append(sum(len(o.state) for _, o in opt._slots))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    _train(model, opt, lambda s: {})
    assert all(not o.state for _, o in opt._slots)
    assert len(list(tmp_path.iterdir())) == len(list(model.parameters()))
    # at each parameter's step only its own state (after its first step) is loaded
    assert max(resident) == 1 and resident.count(1) > 0


def test_held_bytes_are_what_one_optimizer_holds(tmp_path):
    model, twin = _model(1), _model(1)
    one = make_optimizer("adamw", model.parameters())
    _train(model, one, lambda s: {})
    opt = OffloadedOptimizer("adamw", twin.parameters(), tmp_path, "t")
    _train(twin, opt, lambda s: {"last": s == 3})
    states = [t for st in one.state.values() for t in st.values()]
    assert opt.held_bytes(1) == sum(t.untyped_storage().nbytes() for t in states)
    assert opt.held_bytes(512) == sum(-(-t.untyped_storage().nbytes() // 512) * 512 for t in states)


def test_verify_holds_no_optimizer_state_through_forward_and_backward(monkeypatch):
    """The original's and the converted model's optimizer states are on disk while
    either model runs forward and backward (held, they were half the training state
    at verify's peak: GPT-2 124M 1.54x one model's state, 1.16x without)."""
    made: list[OffloadedOptimizer] = []
    resident: list[int] = []

    class Spy(OffloadedOptimizer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    real_fb = verify_single.forward_backward

    def forward_backward(*args, **kwargs):
        resident.append(sum(len(o.state) for m in made for _, o in m._slots))
        return real_fb(*args, **kwargs)

    monkeypatch.setattr(verify_single, "OffloadedOptimizer", Spy)
    monkeypatch.setattr(verify_single, "forward_backward", forward_backward)
    src = load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")
    report = verify_model(src, options(VerifyOptions, steps=3))
    assert report.ok, report.first_failure
    assert len(made) == 2 and len(resident) == 12
    assert resident == [0] * 12
    assert report.memory[0].ok  # the on-disk state is still counted as held


def test_the_estimate_counts_one_parameters_state_at_once():
    src = load_source("sample_models/llama.safetensors", model="sample_models.models:llama")
    report = verify_model(src, options(VerifyOptions, steps=1))
    est = report.budget.estimate
    assert 0 < est.resident_optimizer < est.optimizer
    assert est.resident_state == est.params + est.grads + est.buffers + est.resident_optimizer
