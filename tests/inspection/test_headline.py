"""``inspect``'s first line: the flat layout beside the best other sharding scheme, at
the user's world size or at 8 ranks where that is 1; where the flat layout needs
more, why; and where its root unit outweighs a block, which modules fill it and the
``--unit`` globs that give them units of their own."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from typer.testing import CliRunner

from tests.conftest import SAMPLES
from yafsdp_cli.cli import app
from yafsdp_cli.report.formatting import human_bytes

runner = CliRunner()
LLAMA = str(SAMPLES / "llama.safetensors")
SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/inspect.schema.json").read_text()
)
OTHERS = ("zero2", "zero3", "fsdp")
LABELS = {"zero2": "ZeRO-2*", "zero3": "ZeRO-3*", "fsdp": "FSDP2"}


def inspect_doc(*args: str) -> dict:
    result = runner.invoke(app, ["inspect", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    return doc


def first_screen(*args: str) -> str:
    result = runner.invoke(app, ["inspect", *map(str, args)])
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split("\n\n")[0].split())


def totals(rows: list[dict]) -> dict[str, int]:
    parts = ("params", "grads", "optimizer", "master", "buffers", "gather", "reduce")
    return {r["scheme"]: sum(r[p] for p in parts) for r in rows}


def test_at_world_size_1_the_headline_compares_at_8_ranks_as_inspect_n_8_does():
    """Nothing is sharded at one process (every scheme the same, "saves 0.0%"): the
    headline compares at 8 ranks, says so, and its figures are inspect -n 8's."""
    alone, eight = inspect_doc(LLAMA), inspect_doc(LLAMA, "-n", "8")
    h = alone["headline"]
    assert h["world_size"] == 8 and not h["given"] and eight["headline"]["given"]
    at8 = {s["scheme"]: s["total"] for s in eight["memory"]["schemes"]}
    assert totals(h["schemes"]) == at8
    best = min(OTHERS, key=at8.get)
    assert h["best"] == best
    screen = first_screen(LLAMA)
    assert screen.startswith("at world size 8 (one 8-GPU node; at world size 1 nothing is sharded)")
    assert f"yafsdp flat {human_bytes(at8['yafsdp'])} per rank" in screen
    assert f"{LABELS[best]} {human_bytes(at8[best])}, the best other scheme" in screen
    assert "saves 0.0%" not in screen


def test_where_the_flat_layout_needs_more_the_headline_says_how_much_and_why():
    doc = inspect_doc(LLAMA, "-n", "8")
    h, schemes = doc["headline"], {s["scheme"]: s for s in doc["headline"]["schemes"]}
    flat, best = schemes["yafsdp"], schemes[h["best"]]
    more = totals([flat])["yafsdp"] - totals([best])[h["best"]]
    assert more > 0  # two of each buffer against ZeRO-3's one
    screen = first_screen(LLAMA, "-n", "8")
    assert f"{human_bytes(more)} more than {LABELS[h['best']]}" in screen
    why = screen[screen.index("why: ") :]
    assert f"{human_bytes(flat['gather'] + flat['reduce'])} for {h['largest_unit']}" in why
    assert f"({human_bytes(h['largest_unit_bytes'])})" in why
    assert h["largest_unit"] == doc["memory"]["largest_unit"] == "model.layers.0"
    assert h["outside"] == [] and h["split_flat"] is None  # the blocks are the largest


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    """Tiny Llama configs whose embedding and head each outweigh a block (as
    Llama-3-8B's: 128,256 x 4,096 beside 218M a block), untied and tied."""
    tf = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("wide-vocab")
    for tied in (False, True):
        tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=tied).save_pretrained(root / f"tied-{tied}")  # fmt: skip
    return root


def test_an_embedding_and_head_that_outweigh_a_block_are_units_of_their_own(wide_vocab):
    """By default: so the flat layout's buffers are sized by one of them, not both."""
    folder = wide_vocab / "tied-False"
    doc = inspect_doc(folder, "-n", "8")
    h = doc["headline"]
    assert h["largest_unit"] in ("model.embed_tokens", "lm_head") and h["outside"] == []
    blocks_only = inspect_doc(folder, "-n", "8", "--unit", "model.layers.*")
    assert blocks_only["memory"]["largest_unit"] == ""  # the two together: the root unit
    assert doc["memory"]["flat_bytes"] < blocks_only["memory"]["flat_bytes"]


def test_a_root_unit_outweighing_a_block_names_its_modules_and_the_units_that_fix_it(wide_vocab):
    folder = wide_vocab / "tied-False"
    blocks = ("--unit", "model.layers.*")  # the blocks alone: the root unit holds both
    h = inspect_doc(folder, "-n", "8", *blocks)["headline"]
    assert h["largest_unit"] == "" and h["outside"] == ["model.embed_tokens", "lm_head"]
    assert h["split_units"] == ["model.layers.*", "model.embed_tokens", "lm_head"]
    # the figure is what inspect gives with those units (the default ones), and it is less
    units = [a for g in h["split_units"] for a in ("--unit", g)]
    split = inspect_doc(folder, "-n", "8", *units)
    assert h["split_flat"] == split["memory"]["flat_bytes"]
    assert h["split_flat"] == inspect_doc(folder, "-n", "8")["memory"]["flat_bytes"]
    assert h["split_flat"] < totals(h["schemes"])["yafsdp"]
    assert split["memory"]["largest_unit"] in ("model.embed_tokens", "lm_head")
    screen = first_screen(folder, "-n", "8", *blocks)
    assert "model.embed_tokens and lm_head fill that unit, outside the repeated blocks" in screen
    assert (
        "--unit 'model.layers.*' --unit model.embed_tokens --unit lm_head gives them units of "
        f"their own (flat {human_bytes(h['split_flat'])})"
    ) in screen


def test_a_tied_embedding_and_head_cannot_move_and_are_not_suggested(wide_vocab):
    h = inspect_doc(wide_vocab / "tied-True", "-n", "8")["headline"]
    assert h["largest_unit"] == "" and h["outside"] == [] and h["split_flat"] is None
    assert "--unit" not in first_screen(wide_vocab / "tied-True", "-n", "8")
