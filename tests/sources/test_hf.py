"""Hugging Face model folders: architecture on the meta device, weights that fit it,
tied weights from the module, config-only folders, and life without transformers."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from yafsdp_cli import SourceError
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")
from hf_models import CLASSES, tiny_config  # noqa: E402

pytestmark = pytest.mark.hf
runner = CliRunner()
HF_CLASSES = {k: v for k, v in CLASSES.items() if k != "bert"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each tiny model saved with save_pretrained (llama in bf16)."""
    out = {}
    for name, cls in HF_CLASSES.items():
        torch.manual_seed(0)
        model = getattr(tf, cls)(tiny_config(name))
        if name == "llama":
            model = model.to(torch.bfloat16)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = path
    return out


def reference(folder, name):
    return getattr(tf, HF_CLASSES[name]).from_pretrained(folder)


@pytest.mark.parametrize("name", sorted(HF_CLASSES))
def test_folder_builds_the_architecture_and_the_same_weights(folders, name):
    loaded = load_source(folders[name])
    assert loaded.spec.has_architecture and loaded.spec.source_kind == "hf"
    assert type(loaded.module).__name__ == HF_CLASSES[name]
    assert all(p.device.type == "meta" for p in loaded.module.parameters())
    model = loaded.build_module()
    expected = reference(folders[name], name).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for key, t in expected.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    for record in loaded.spec.params:  # every parameter's bytes are reachable
        stored = loaded.stored_name(record)
        assert loaded.reader.nbytes(stored) == record.nbytes


def test_gpt2_tied_head_comes_from_the_module(folders):
    spec = load_source(folders["gpt2"]).spec
    wte = spec.by_name()["transformer.wte.weight"]
    assert wte.aliases == ("lm_head.weight",)
    assert spec.by_name()["transformer.h.0.attn.c_attn.weight"].kinds == ("linear",)  # Conv1D
    assert spec.units == ("transformer.h.0", "transformer.h.1")


def test_t5_shares_one_embedding_four_ways(folders):
    spec = load_source(folders["t5"]).spec
    shared = spec.by_name()["shared.weight"]
    assert set(shared.names) == {
        "shared.weight",
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "lm_head.weight",
    }


def test_weights_dtypes_win(folders):
    spec = load_source(folders["llama"]).spec
    assert {t.dtype for t in spec.params} == {"bfloat16"}


def test_mixtral_is_described_as_transformers_holds_it(folders):
    loaded = load_source(folders["mixtral"])
    names = {t.name for t in loaded.spec.params}
    if "model.layers.0.mlp.experts.gate_up_proj" in names:  # transformers 5: fused experts
        assert any("converts them on load" in n for n in loaded.spec.notes)
    else:  # transformers 4: stored as it is held
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
    assert loaded.spec.units == ("model.layers.0", "model.layers.1")


def test_config_only_folder_costs_no_memory(tmp_path):
    cfg = tf.LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        dtype="bfloat16",
    )
    cfg.save_pretrained(tmp_path)
    loaded = load_source(tmp_path)
    assert loaded.reader is None
    assert all(p.device.type == "meta" for p in loaded.module.parameters())
    assert sum(t.numel for t in loaded.spec.params) == 68_976_648_192
    assert {t.dtype for t in loaded.spec.params} == {"bfloat16"}
    assert any("config.json alone" in n for n in loaded.spec.notes)
    result = runner.invoke(app, ["inspect", str(tmp_path), "-n", "64", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["params"]["total_numel"] == 68_976_648_192 and len(doc["units"]) == 80


def test_base_model_prefix_is_mapped(folders, tmp_path):
    """Weights saved from LlamaForCausalLM (``model.`` names) into a LlamaModel config."""
    model = reference(folders["llama"], "llama")
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    cfg["architectures"] = ["LlamaModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_source(tmp_path)
    assert type(loaded.module).__name__ == "LlamaModel"
    assert any("'model' prefix" in n for n in loaded.spec.notes)
    record = loaded.spec.by_name()["layers.0.mlp.up_proj.weight"]
    assert torch.equal(
        loaded.reader.load(loaded.stored_name(record)),
        weights["model.layers.0.mlp.up_proj.weight"],
    )
    base = loaded.build_module()
    assert torch.equal(base.norm.weight, weights["model.norm.weight"])


def copy_folder(src, dst, edit_config=None, extra_tensors=None):
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file

    weights = load_file(src / "model.safetensors")
    weights.update(extra_tensors or {})
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_weights_that_do_not_fit_are_refused(folders, tmp_path):
    path = copy_folder(folders["gpt2"], tmp_path, extra_tensors={"junk.weight": torch.ones(3)})
    with pytest.raises(SourceError, match="the weights do not fit GPT2LMHeadModel.*junk.weight"):
        load_source(path)


CONFIG_CASES = {
    "quantized": (
        lambda c: c.update(quantization_config={"quant_method": "gptq"}),
        "a gptq checkpoint .* quantized weights are not supported",
    ),
    "remote code": (
        lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_x.X"}, architectures=["X"]),
        "the folder's own code .* pass --trust-pickle",
    ),
    "unknown model_type": (
        lambda c: c.update(model_type="no-such-model", architectures=[]),
        "transformers cannot read it",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_configs_are_refused(folders, tmp_path, case):
    edit, message = CONFIG_CASES[case]
    path = copy_folder(folders["gpt2"], tmp_path, edit_config=edit)
    with pytest.raises(SourceError, match=message):
        load_source(path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SourceError, match="config.json: not valid JSON"):
        load_source(tmp_path)


def test_hf_folder_through_the_cli_with_kind_filters(folders):
    result = runner.invoke(
        app, ["inspect", str(folders["gpt2"]), "--filter", "linear", "-n", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    names = {e["name"] for b in doc["buffers"] for e in b["entries"]}
    # Conv1D layers count as linear; so does the tied embedding, through lm_head (a Linear)
    assert "transformer.wte.weight" in names and "transformer.wpe.weight" not in names
    assert all(".attn.c_" in n or ".mlp.c_" in n for n in names - {"transformer.wte.weight"})
    assert {"name": "transformer.wte.weight", "aliases": ["lm_head.weight"]} in doc["params"][
        "shared"
    ]


# ---------------------------------------------------------------- without transformers


@pytest.fixture
def no_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError


def test_without_transformers_falls_back_to_the_weights(folders, no_transformers):
    loaded = load_source(folders["gpt2"])
    assert not loaded.spec.has_architecture and loaded.spec.source_kind == "safetensors"
    assert "pip install 'yafsdp-cli[hf]'" in loaded.spec.notes[0]
    with pytest.raises(SourceError, match="needs its architecture: .*yafsdp-cli\\[hf\\]"):
        loaded.build_module()
    result = runner.invoke(app, ["inspect", str(folders["gpt2"]), "--filter", "linear"])
    assert result.exit_code == 2
    assert "transformers is not installed: pip install 'yafsdp-cli[hf]'" in result.stderr


def test_without_transformers_a_config_only_folder_is_an_error(tmp_path, no_transformers):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SourceError, match="only config.json .* pip install 'yafsdp-cli\\[hf\\]'"):
        load_source(tmp_path)
