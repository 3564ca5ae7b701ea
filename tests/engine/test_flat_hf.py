"""The engine on real Hugging Face architectures (tied, shared, encoder-decoder, MoE)."""

from __future__ import annotations

import copy

import pytest
import torch

from yafsdp_cli import TensorRecord, convert_module, plan, spec_from_module
from yafsdp_cli.engine.inputs import projection_loss
from yafsdp_cli.engine.units import detect_units_from_names
from yafsdp_cli.options import LayoutOptions

tf = pytest.importorskip("transformers")
from hf_models import VOCAB, tiny_model  # noqa: E402


def tiny(name: str):
    return tiny_model(name)


def train(model, flat=None, steps=2, micro=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    history = []
    for step in range(steps):
        for m in range(micro):
            g = torch.Generator().manual_seed(10 * step + m)
            ids = torch.randint(0, VOCAB, (2, 8), generator=g)
            kwargs = {"input_ids": ids}
            if model.config.is_encoder_decoder:
                kwargs["decoder_input_ids"] = ids.flip(1)
            projection_loss(model(**kwargs).logits, seed=step).backward()
        grads = (
            flat.named_grads()
            if flat
            else {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
        )
        history.append({n: None if v is None else v.clone() for n, v in grads.items()})
        opt.step()
        opt.zero_grad()
    params = (
        flat.named_params()
        if flat
        else {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    )
    return history, {n: p.clone() for n, p in params.items()}


@pytest.mark.parametrize(
    ("name", "tied"),
    [
        ("gpt2", {"transformer.wte.weight": ("lm_head.weight",)}),
        (
            "t5",
            {
                "shared.weight": (
                    "encoder.embed_tokens.weight",
                    "decoder.embed_tokens.weight",
                    "lm_head.weight",
                )
            },
        ),
        ("mixtral", {}),
        (
            "bert",
            {
                "bert.embeddings.word_embeddings.weight": ("cls.predictions.decoder.weight",),
                "cls.predictions.bias": ("cls.predictions.decoder.bias",),
            },
        ),
    ],
)
def test_hf_models_train_identically_once_converted(name, tied):
    torch.manual_seed(0)
    model = tiny(name)
    model.config.dropout_rate = model.config.hidden_dropout_prob = 0.0
    model.eval()  # dropout off; gradients still flow
    spec = spec_from_module(model)
    assert {t.name: t.aliases for t in spec.tensors if t.aliases} == tied
    twin = copy.deepcopy(model)
    flat = convert_module(twin, plan(spec, LayoutOptions(world_size=3, align="fsdp")))
    ref_grads, ref_params = train(model)
    got_grads, got_params = train(twin, flat)
    for step, (a, b) in enumerate(zip(ref_grads, got_grads)):
        assert a.keys() == b.keys()
        for n in a:
            assert (a[n] is None) == (b[n] is None), (step, n)
            if a[n] is not None:
                assert torch.equal(a[n], b[n]), (step, n)
    for n, p in ref_params.items():
        assert torch.equal(p, got_params[n]), n
    flat.check_padding()
    restored = flat.restore()
    for owner, aliases in tied.items():
        for alias in aliases:
            assert restored.get_parameter(alias) is restored.get_parameter(owner)


def test_encoder_and_decoder_stacks_are_both_units():
    model = tiny("t5")
    spec = spec_from_module(model)
    expected = ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    assert spec.units == expected
    bare = tuple(TensorRecord(t.name, t.shape, t.dtype) for t in spec.tensors)
    assert detect_units_from_names(bare) == expected
