"""The filter language and unit detection, with and without an architecture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import build

from yafsdp_cli import FilterError, ModelSpec, TensorRecord, plan, spec_from_module
from yafsdp_cli.engine.filters import select
from yafsdp_cli.engine.units import assign_units, detect_units_from_names, resolve_unit_globs
from yafsdp_cli.options import LayoutOptions


def picked(filters, excludes=()):
    """What ``select`` reads of a layout (``LayoutOptions`` checks expressions when it
    is made; this leaves them to ``select``, whose own checks these tests are)."""
    return SimpleNamespace(filters=tuple(filters), excludes=tuple(excludes))


def names(records):
    return [t.name for t in records]


@pytest.fixture(scope="module")
def llama():
    return spec_from_module(build("llama"))


def names_only(spec: ModelSpec) -> ModelSpec:
    """The same tensors as a header would show them: no kinds, no types."""
    bare = tuple(TensorRecord(t.name, t.shape, t.dtype, is_param=t.is_param) for t in spec.tensors)
    return ModelSpec(bare, has_architecture=False, units=detect_units_from_names(bare))


def test_default_selects_every_floating_parameter(llama):
    assert names(select(llama)) == names(llama.params)
    assert "model.rotary_emb.inv_freq" not in names(select(llama))


@pytest.mark.parametrize(
    ("expr", "count", "example"),
    [
        ("linear", 15, "model.layers.0.self_attn.q_proj.weight"),
        ("embedding", 1, "model.embed_tokens.weight"),
        ("norm", 5, "model.norm.weight"),
        ("type:RMSNorm", 5, "model.layers.1.input_layernorm.weight"),
        ("name:*.mlp.*", 6, "model.layers.0.mlp.up_proj.weight"),
        ("re:layers\\.1\\..*proj", 7, "model.layers.1.mlp.down_proj.weight"),
        ("dtype:fp32", 5, "model.norm.weight"),
        ("min-numel:16384", 2, "lm_head.weight"),
        ("all", 21, "lm_head.weight"),
    ],
)
def test_each_filter_kind(llama, expr, count, example):
    chosen = names(select(llama, picked([expr])))
    assert len(chosen) == count and example in chosen


def test_filters_union_and_exclude(llama):
    chosen = names(select(llama, picked(["embedding", "norm"], ["name:model.layers.*"])))
    assert chosen == ["model.embed_tokens.weight", "model.norm.weight"]


def test_conv_kind_and_tied_alias_matching():
    cnn = spec_from_module(build("cnn"))
    assert names(select(cnn, picked(["conv"]))) == [
        "features.0.weight",
        "features.0.bias",
        "features.4.weight",
        "features.4.bias",
    ]
    gpt = spec_from_module(build("gpt"))
    # The tied weight matches through either owner: its alias is a Linear's weight.
    assert "transformer.wte.weight" in names(select(gpt, picked(["name:lm_head.*"])))
    assert "transformer.wte.weight" in names(select(gpt, picked(["linear"])))


def test_filter_matching_nothing_lists_what_exists(llama):
    with pytest.raises(
        FilterError,
        match=r"'conv' matches no parameter; the model has 21 "
        r"parameters; kinds linear \(15\).*names like model\.embed_tokens\.weight",
    ):
        select(llama, picked(["conv"]))


def test_module_kind_filter_without_architecture_says_how_to_give_one(llama):
    with pytest.raises(FilterError, match="'linear' needs the model's architecture.*--model"):
        select(names_only(llama), picked(["linear"]))
    assert len(select(names_only(llama), picked(["name:*proj*"]))) == 14


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("lin", "cannot parse filter 'lin'"),
        ("size:3", "unknown kind 'size'"),
        ("re:(", "bad regular expression"),
        ("dtype:fp12", "unknown dtype 'fp12'"),
        ("min-numel:ten", "whole number"),
        ("name:", "cannot parse filter"),
    ],
)
def test_malformed_filters(llama, expr, message):
    with pytest.raises(FilterError, match=message):
        select(llama, picked([expr]))


def test_units_from_names_match_units_from_module(llama):
    assert llama.units == ("model.layers.0", "model.layers.1")
    assert names_only(llama).units == llama.units
    moe = spec_from_module(build("moe"))
    assert moe.units == ("blocks.0", "blocks.1")  # the block list, not the expert lists
    assert names_only(moe).units == moe.units
    # An nn.Sequential of single layers has no repeated blocks.
    assert names_only(spec_from_module(build("mlp"))).units == ()


def test_unit_globs_keep_the_outermost_match(llama):
    assert resolve_unit_globs(["model.layers.*"], llama.module_names) == llama.units
    assert resolve_unit_globs(["*.mlp"], llama.module_names) == (
        "model.layers.0.mlp",
        "model.layers.1.mlp",
    )
    with pytest.raises(
        FilterError,
        match="--unit 'decoder.*' matches no module; modules look "
        "like: model, model.embed_tokens, model.layers",
    ):
        resolve_unit_globs(["decoder.*"], llama.module_names)
    layout = plan(llama, LayoutOptions(units=["*.mlp"]))
    assert {b.unit for b in layout.buffers} == {"", "model.layers.0.mlp", "model.layers.1.mlp"}


def test_weight_tied_across_units_goes_to_root():
    spec = ModelSpec(
        (
            TensorRecord("blocks.0.w", (2,), "float32", aliases=("blocks.1.w",)),
            TensorRecord("blocks.1.v", (2,), "float32"),
        ),
        has_architecture=False,
    )
    assert assign_units(spec, ("blocks.0", "blocks.1")) == {
        "blocks.0.w": "",
        "blocks.1.v": "blocks.1",
    }


def _wide(vocab: int, tied: bool = False) -> ModelSpec:
    """Names only: an embedding and a head of ``vocab`` rows of 8 beside two blocks of
    8x8 + 8x8 (128 elements each), float32."""
    tensors = [TensorRecord("embed.weight", (vocab, 8), "float32")]
    for i in range(2):
        tensors += [TensorRecord(f"layers.{i}.{n}.weight", (8, 8), "float32") for n in "ab"]
    tensors.append(TensorRecord("norm.weight", (8,), "float32"))
    head = TensorRecord("head.weight", (vocab, 8), "float32")
    if tied:
        tensors[0] = TensorRecord("embed.weight", (vocab, 8), "float32", aliases=("head.weight",))
    else:
        tensors.append(head)
    modules = ("embed", "layers", "layers.0", "layers.1", "norm", *(() if tied else ("head",)))
    return ModelSpec(
        tuple(tensors), has_architecture=False, units=("layers.0", "layers.1"), module_names=modules
    )


@pytest.mark.parametrize(
    ("vocab", "tied", "split"),
    [
        (16, False, ("embed", "head")),  # 128 elements each: as large as a block
        (15, False, ()),  # one row short of a block
        (64, True, ()),  # a tied head's weight is the embedding's: it cannot move
    ],
)
def test_modules_outweighing_a_block_get_units_of_their_own(vocab, tied, split):
    layout = plan(_wide(vocab, tied))
    assert layout.units == ("layers.0", "layers.1", *split) and layout.split == split
    assert layout.blocks == ("layers.0", "layers.1")  # what checkpointing wraps
    owner = {b.unit for b in layout.buffers for e in b.entries if e.name == "embed.weight"}
    assert owner == {split[0] if split else ""}
    # given units are the user's, whole: nothing is split beside them
    given = plan(_wide(vocab, tied), LayoutOptions(units=("layers.*",)))
    assert given.units == ("layers.0", "layers.1") and given.split == ()


def test_a_split_layout_reads_back_from_its_metadata():
    from yafsdp_cli.engine.layout import layout_from_dict, layout_to_dict

    split, plain = plan(_wide(16)), plan(_wide(15))
    assert layout_from_dict(layout_to_dict(split)) == split
    assert "split" not in layout_to_dict(plain)  # a layout without one reads as before
    assert layout_from_dict(layout_to_dict(plain)) == plain
