"""A converted model under the idioms of real training code, gradient by gradient.

Each test runs the original and a converted copy under the same idiom (activation
checkpointing of whole blocks or of parts of them, reentrant or not, directly or
through transformers; torch.compile; gradient clipping; deepcopy; state_dict) and
asserts every output, every parameter's gradient by name (tied names too, ``None``
where the original has ``None``) and every parameter after each optimizer step are
equal bit for bit. Asserting the loss alone would not have caught a model whose
checkpointed blocks silently got no gradient.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import build
from torch.utils.checkpoint import checkpoint

from yafsdp_cli import ConversionError, convert_module, plan, spec_from_module
from yafsdp_cli.engine.flat import flat_handle
from yafsdp_cli.engine.inputs import make_input, projection_loss
from yafsdp_cli.options import LayoutOptions

tf = pytest.importorskip("transformers")
from hf_models import VOCAB, tiny_model  # noqa: E402

CHECKPOINTING = ("none", "reentrant", "non-reentrant")


def hf(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return tiny_model(name).train()  # dropout on, as in training


def hf_batch(step: int, micro: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + micro)
    return {"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)}


def forward(model, step: int, micro: int):
    if isinstance(model, tf.PreTrainedModel) or hasattr(model, "_orig_mod"):
        return model(**hf_batch(step, micro)).logits
    return model(make_input(model, seed=100 * step + micro))


def converted(model, **plan_kwargs):
    twin = copy.deepcopy(model)
    return twin, convert_module(twin, plan(spec_from_module(twin), LayoutOptions(**plan_kwargs)))


def train(model, *, params=None, steps=3, micro=2, clip=None):
    """Seeded steps of accumulated micro-batches: every output, every gradient by name
    (as the module reports it), every parameter after the step."""
    opt = torch.optim.AdamW(params or model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    record = []
    for step in range(steps):
        outs = []
        for m in range(micro):
            torch.manual_seed(7 * step + m)  # dropout draws the same on both sides
            out = forward(model, step, m)
            projection_loss(out, seed=step).backward()
            outs.append(out.detach().clone())
        named = model.named_parameters(remove_duplicate=False)
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in named}
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        opt.step()
        opt.zero_grad()
        named = model.named_parameters(remove_duplicate=False)
        record.append((outs, grads, {n: p.detach().clone() for n, p in named}))
    return record


def assert_same(want, got) -> None:
    for step, ((o1, g1, p1), (o2, g2, p2)) in enumerate(zip(want, got, strict=True)):
        for m, (a, b) in enumerate(zip(o1, o2, strict=True)):
            assert torch.equal(a, b), f"step {step} micro-batch {m}: outputs differ"
        assert g1.keys() == g2.keys() and p1.keys() == p2.keys()
        for name, a in g1.items():
            b = g2[name]
            assert (a is None) == (b is None), f"step {step}: gradient of {name}: {a} vs {b}"
            assert a is None or torch.equal(a, b), f"step {step}: gradient of {name} differs"
        for name, a in p1.items():
            assert torch.equal(a, p2[name]), f"step {step}: {name} after the step differs"


def hf_checkpointing(model, mode: str):
    if mode != "none":
        kwargs = {"use_reentrant": mode == "reentrant"}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def checkpoint_parts(model, mode: str, part: str):
    """``torch.utils.checkpoint`` called directly on every submodule named ``part``
    (reentrant checkpointing takes positional arguments only: parts called so)."""
    if mode == "none":
        return
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] == part:
            m.forward = functools.partial(
                checkpoint, m.forward, use_reentrant=mode == "reentrant", preserve_rng_state=True
            )


@pytest.mark.parametrize("mode", CHECKPOINTING)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("on", ["flat", "params"])
def test_hf_gradient_checkpointing_trains_bit_exact(name, mode, on):
    model = hf(name)
    hf_checkpointing(model, mode)
    twin, flat = converted(model, world_size=2)
    want = train(model)
    got = train(twin, params=flat.parameters() if on == "flat" else None)
    assert_same(want, got)
    with torch.no_grad():
        forward(twin, 0, 0)  # the next step's forward sees the optimizer's zero_grad
    assert all(p.grad is None for p in twin.parameters())
    assert all(b.grad is None for b in flat.buffers)  # the flat gradient is freed


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_checkpointing_enabled_after_conversion(mode):
    model = hf("llama")
    twin, flat = converted(model)
    hf_checkpointing(model, mode)
    hf_checkpointing(twin, mode)
    assert_same(train(model), train(twin, params=flat.parameters()))


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize(("name", "part"), [("llama", "mlp"), ("gpt2", "mlp"), ("gpt", "mlp")])
def test_torch_checkpoint_on_parts_of_blocks(name, part, mode):
    model = hf(name) if name in ("llama", "gpt2") else build(name).train()
    checkpoint_parts(model, mode, part)
    twin, flat = converted(model, world_size=4)
    assert_same(train(model), train(twin, params=flat.parameters()))


@pytest.mark.parametrize("sample", ["gpt", "llama", "moe"])
def test_bundled_samples_under_reentrant_checkpointing(sample):
    model = build(sample).train()
    checkpoint_parts(model, "reentrant", "0")  # the first block of each stack
    twin, flat = converted(model, world_size=2)
    assert_same(train(model), train(twin, params=flat.parameters()))


def test_gradient_clipping_over_the_module_parameters():
    model = hf("gpt2")
    twin, flat = converted(model)
    assert_same(train(model, clip=0.05), train(twin, params=flat.parameters(), clip=0.05))


def test_torch_compile_one_graph_no_break_and_bit_exact():
    model = hf("llama").eval()  # no dropout: compiled RNG is not eager's
    twin, flat = converted(model)
    ids = hf_batch(0, 0)["input_ids"]
    for m in (model, twin):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m)(input_ids=ids)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained
    torch._dynamo.reset()
    want = train(torch.compile(model, backend="aot_eager"), steps=2)
    got = train(torch.compile(twin, backend="aot_eager"), params=flat.parameters(), steps=2)
    assert_same(want, got)


def test_state_dict_speaks_the_original_names():
    model = hf("gpt2")
    twin, flat = converted(model)
    want = model.state_dict()
    got = twin.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = hf("gpt2", seed=1)
    fresh.load_state_dict(got)  # a plain model takes the converted one's state dict
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
    other = {k: v + 1 for k, v in hf("gpt2", seed=2).state_dict().items()}
    twin.load_state_dict(other)  # and the converted one takes a plain one, into its buffers
    name = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(flat.param(name), other[name])
    assert twin.lm_head.weight is twin.transformer.wte.weight  # still tied
    assert flat.flat_state_dict().keys() >= {b.layout.name for b in flat.buffers}


def test_save_pretrained_round_trip(tmp_path):
    model = hf("llama")
    twin, _ = converted(model)
    twin.save_pretrained(tmp_path)
    back = tf.LlamaForCausalLM.from_pretrained(tmp_path)
    assert back.config.architectures == ["LlamaForCausalLM"]
    want = model.state_dict()
    assert all(torch.equal(back.state_dict()[k], want[k]) for k in want)


def test_deepcopy_is_converted_too_and_independent():
    model = hf("gpt2")
    twin, flat = converted(model, world_size=2)
    copied = copy.deepcopy(twin)
    handle = flat_handle(copied)
    assert handle is not flat and type(copied).__name__ == "GPT2LMHeadModel"
    p = copied.transformer.h[0].mlp.c_fc.weight
    home = handle.param("transformer.h.0.mlp.c_fc.weight")  # a view of the copy's buffer
    assert p.untyped_storage()._cdata == home.untyped_storage()._cdata
    assert copied.lm_head.weight is copied.transformer.wte.weight
    assert_same(train(model), train(copied, params=handle.parameters()))
    original = twin.transformer.h[0].mlp.c_fc.weight
    assert not torch.equal(original, p)  # training the copy left the first alone


def test_moving_parameters_after_conversion_is_an_error_not_silence():
    model = build("mlp")
    twin, _ = converted(model)
    twin.double()
    with pytest.raises(ConversionError, match=r"net\.0\.weight was given other storage"):
        twin(make_input(model).double())
    model2 = build("mlp")
    twin2, _ = converted(model2)
    twin2.load_state_dict(build("mlp", seed=3).state_dict(), assign=True)
    with pytest.raises(ConversionError, match="was replaced after conversion"):
        twin2(make_input(model2))


def test_restore_after_idioms_gives_the_plain_module_back():
    model = hf("gpt2")
    hf_checkpointing(model, "reentrant")
    twin, flat = converted(model)
    train(twin, params=flat.parameters(), steps=1)
    plain = flat.restore()
    assert type(plain) is tf.GPT2LMHeadModel
    assert plain.lm_head.weight is plain.transformer.wte.weight
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in plain.parameters())
