"""`yafsdp inspect` through the CLI: formats, the JSON contract, every filter kind,
folding, and each usage error."""

from __future__ import annotations

import json
import struct
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from tests.conftest import SAMPLES
from tests.helpers import build
from yafsdp_cli.cli import app

runner = CliRunner()
LLAMA = str(SAMPLES / "llama.safetensors")
LLAMA_ARCH = ["--model", "sample_models.models:llama"]
SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/inspect.schema.json").read_text()
)


def invoke(*args: str):
    return runner.invoke(app, ["inspect", *map(str, args)])


def inspect_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)  # exactly one document, nothing else on stdout
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    return doc


def converted(doc: dict) -> set[str]:
    return {e["name"] for b in doc["buffers"] for e in b["entries"]}


def failure(*args: str) -> str:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output
    return " ".join(result.stderr.split())


# ---------------------------------------------------------------- formats


SOURCES = {
    "safetensors": [LLAMA],
    "state dict": [SAMPLES / "mlp.pt"],
    "pickled module": [SAMPLES / "gpt_module.pt", "--trust-pickle"],
    "factory": LLAMA_ARCH,
    "factory + weights": [SAMPLES / "cnn.safetensors", "--model", "sample_models.models:cnn"],
}


@pytest.mark.parametrize("kind", sorted(SOURCES))
@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_every_source_in_every_format(kind, fmt):
    result = invoke(*SOURCES[kind], "--world-size", "4", "--format", fmt)
    assert result.exit_code == 0, result.output
    if fmt == "json":
        jsonschema.validate(json.loads(result.stdout), SCHEMA)
    else:
        assert "memory per rank at world size 4" in result.stdout
        # the table keeps the method for --explain; markdown always has it
        head = "Notes and assumptions" if fmt == "markdown" else "Notes"
        assert head in result.stdout


def test_inspect_explain_adds_how_each_scheme_is_modelled():
    short = invoke(LLAMA, "-n", "8").stdout
    full = invoke(LLAMA, "-n", "8", "--explain").stdout
    assert "lines on how each scheme is modelled: --explain" in short
    method = "zero2 and zero3 are reference estimates"
    assert method not in " ".join(short.split()) and method in " ".join(full.split())
    assert "Notes and assumptions" in full


def test_table_names_the_largest_unit_and_every_scheme():
    out = invoke(LLAMA, "-n", "8").stdout
    for word in ("DDP", "yafsdp", "ZeRO-2*", "ZeRO-3*", "FSDP2", "largest unit: model.layers.0"):
        assert word in out
    assert "shards" in out and "padding" in out


def test_markdown_lists_assumptions():
    out = invoke(LLAMA, "--format", "markdown", "--optimizer", "sgd").stdout
    assert "### Notes and assumptions" in out
    assert "- optimizer sgd: 1 state(s) per trainable element" in out
    assert "- no architecture: every floating-point tensor counts as a parameter" in out
    assert "| total per rank |" in out


# ---------------------------------------------------------------- JSON contract


def test_json_contract_on_tied_gpt():
    doc = inspect_json(
        SAMPLES / "gpt.safetensors", "--model", "sample_models.models:gpt", "-n", "4"
    )
    model = build("gpt")
    unique = {id(p): p.numel() for p in model.parameters()}
    assert doc["params"]["total_numel"] == sum(unique.values())  # tied counted once
    assert doc["params"]["converted_numel"] == sum(unique.values())
    assert doc["params"]["shared"] == [
        {"name": "transformer.wte.weight", "aliases": ["lm_head.weight"]}
    ]
    for b in doc["buffers"]:
        assert b["numel"] == sum(e["numel"] for e in b["entries"])
        assert b["padded_numel"] == b["shard_numel"] * 4 >= b["numel"]
        ends = [e["offset"] + e["numel"] for e in b["entries"]]
        assert all(e["offset"] >= end for e, end in zip(b["entries"][1:], ends))
    m = doc["memory"]
    assert m["savings_bytes"] == m["baseline_bytes"] - m["flat_bytes"]
    schemes = {s["scheme"]: s for s in m["schemes"]}
    assert schemes["ddp"]["total"] == m["baseline_bytes"]
    assert schemes["yafsdp"]["total"] == m["flat_bytes"]
    assert m["largest_unit"] == "transformer.h.0"
    assert doc["inputs"] == {
        "source": f"{SAMPLES / 'gpt.safetensors'} with --model sample_models.models:gpt",
        "model": "sample_models.models:gpt",
        "filters": [],
        "excludes": [],
        "unit_globs": [],
        "world_size": 4,
        "align": "yafsdp",
        "param_dtype": None,
        "grad_dtype": None,
        "optimizer": "adamw",
        "master_weights": None,
        "round_bytes": 512,
        "fsdp_placement": "dim0",
        "freeze": [],
        "lora": None,
        "quantize": None,
    }


def test_json_records_every_option():
    doc = inspect_json(
        LLAMA,
        *("--filter", "name:*.mlp.*", "--exclude", "name:*down*", "--unit", "model.layers.*"),
        *("--align", "megatron", "-n", "2", "--param-dtype", "fp16", "--grad-dtype", "fp32"),
        *("--optimizer", "sgd", "--no-master-weights"),
    )
    inputs = doc["inputs"]
    assert inputs["filters"] == ["name:*.mlp.*"] and inputs["excludes"] == ["name:*down*"]
    assert inputs["unit_globs"] == ["model.layers.*"] and inputs["align"] == "megatron"
    assert (inputs["param_dtype"], inputs["grad_dtype"]) == ("float16", "float32")
    assert (inputs["optimizer"], inputs["master_weights"]) == ("sgd", False)
    assert converted(doc) == {
        f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up")
    }
    assert {b["dtype"] for b in doc["buffers"]} == {"float16"}  # planned in the training dtype
    assert all(b["end_multiple"] == 128 and b["start_align"] == 64 for b in doc["buffers"])
    assert any("parameters in float16 (--param-dtype)" in a for a in doc["assumptions"])


def test_master_weights_flag_changes_the_figures():
    on = inspect_json(LLAMA, "--master-weights")["memory"]["schemes"][0]
    off = inspect_json(LLAMA, "--no-master-weights")["memory"]["schemes"][0]
    assert on["master"] > 0 and off["master"] == 0
    assert off["optimizer"] < on["optimizer"]  # states in bf16 instead of fp32


def test_json_at_world_size_one_has_nothing_gathered():
    m = inspect_json(SAMPLES / "mlp.safetensors")["memory"]["schemes"][1]
    assert (m["gather"], m["reduce"]) == (0, 0)


# ---------------------------------------------------------------- filters


def llama_names(kind: str) -> set[str]:
    """Parameter names of the llama sample by module kind, from the module itself."""
    from torch import nn

    model = build("llama")
    kinds = {"linear": nn.Linear, "embedding": nn.Embedding}
    if kind == "norm":
        return {n for n, _ in model.named_parameters() if "norm" in n}
    return {
        f"{m_name}.{p}"
        for m_name, m in model.named_modules()
        if isinstance(m, kinds[kind])
        for p, _ in m.named_parameters(recurse=False)
    }


@pytest.mark.parametrize("kind", ["linear", "embedding", "norm"])
def test_module_kind_filters(kind):
    doc = inspect_json(*LLAMA_ARCH, "--filter", kind)
    assert converted(doc) == llama_names(kind)
    assert doc["params"]["unconverted_numel"] == doc["params"]["total_numel"] - sum(
        e["numel"] for b in doc["buffers"] for e in b["entries"]
    )


def test_conv_filter_on_the_cnn():
    doc = inspect_json(*["--model", "sample_models.models:cnn"], "--filter", "conv")
    assert converted(doc) == {f"features.{i}.{p}" for i in (0, 4) for p in ("weight", "bias")}
    assert doc["module_buffers"]["count"] == 6  # BatchNorm statistics are never converted


def test_type_filter():
    doc = inspect_json(*LLAMA_ARCH, "--filter", "type:RMSNorm")
    assert converted(doc) == llama_names("norm")


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            "name:*.self_attn.q_proj.*",
            {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"},
        ),
        (
            "re:layers\\.1\\..*norm",
            {
                "model.layers.1.input_layernorm.weight",
                "model.layers.1.post_attention_layernorm.weight",
            },
        ),
        ("min-numel:16384", {"lm_head.weight", "model.embed_tokens.weight"}),
    ],
)
def test_name_regex_and_size_filters(expr, expected):
    assert converted(inspect_json(LLAMA, "--filter", expr)) == expected


def test_dtype_all_and_exclude_filters():
    fp32 = converted(inspect_json(LLAMA, "--filter", "dtype:fp32"))
    bf16 = converted(inspect_json(LLAMA, "--filter", "dtype:bf16"))
    everything = converted(inspect_json(LLAMA, "--filter", "all"))
    assert fp32 and bf16 and fp32 | bf16 == everything and not fp32 & bf16
    assert "model.norm.weight" in fp32
    excluded = converted(inspect_json(LLAMA, "--exclude", "dtype:fp32"))
    assert excluded == bf16
    both = converted(inspect_json(LLAMA, "--filter", "dtype:fp32", "--filter", "name:lm_head.*"))
    assert both == fp32 | {"lm_head.weight"}  # any filter matching is enough


def test_tied_alias_matches_a_name_filter():
    doc = inspect_json(SAMPLES / "gpt_module.pt", "--trust-pickle", "--filter", "name:lm_head.*")
    assert converted(doc) == {"transformer.wte.weight"}  # the canonical name; lm_head an alias


def test_unit_globs():
    doc = inspect_json(*LLAMA_ARCH, "--unit", "model.layers.*.mlp")
    assert doc["units"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert {b["unit"] for b in doc["buffers"]} == {"", "model.layers.0.mlp", "model.layers.1.mlp"}


# ---------------------------------------------------------------- folding


def write_header_only(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]]) -> Path:
    """A sparse safetensors file: a real header, then a hole as long as the data."""
    sizes = {"BF16": 2, "F32": 4}
    header, pos = {}, 0
    for name, (shape, dtype) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + pos)
    return path


def test_long_tables_fold_and_all_unfolds(tmp_path):
    path = write_header_only(
        tmp_path / "wide.safetensors", {f"p{i:02d}": ((8,), "F32") for i in range(40)}
    )
    folded = invoke(path, "-n", "16", "--format", "markdown").stdout
    assert "... 20 more entries (--all shows them)" in folded
    assert "10 more ranks (--all shows them)" in folded
    assert "| p39 |" in folded and "| p20 |" not in folded
    full = invoke(path, "-n", "16", "--format", "markdown", "--all").stdout
    assert "more entries" not in full and "more ranks" not in full
    assert "| p20 |" in full and "| 15 |" in full


def test_repeated_blocks_are_shown_once():
    folded = invoke(LLAMA, "--format", "markdown").stdout
    assert "+1 more buffers with this layout: model.layers.1" in folded
    assert "model.layers.1.mlp.up_proj.weight" not in folded
    full = invoke(LLAMA, "--format", "markdown", "--all").stdout
    assert "model.layers.1.mlp.up_proj.weight" in full


LLAMA_70B = {
    "vocab": 32000,
    "hidden": 8192,
    "layers": 80,
    "inter": 28672,
    "kv": 1024,
}


def llama_70b_tensors() -> dict[str, tuple[tuple[int, ...], str]]:
    h, v, i, kv = (LLAMA_70B[k] for k in ("hidden", "vocab", "inter", "kv"))
    out = {"model.embed_tokens.weight": ((v, h), "BF16")}
    for n in range(LLAMA_70B["layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": ((h,), "BF16"),
            p + "post_attention_layernorm.weight": ((h,), "BF16"),
            p + "self_attn.q_proj.weight": ((h, h), "BF16"),
            p + "self_attn.k_proj.weight": ((kv, h), "BF16"),
            p + "self_attn.v_proj.weight": ((kv, h), "BF16"),
            p + "self_attn.o_proj.weight": ((h, h), "BF16"),
            p + "mlp.gate_proj.weight": ((i, h), "BF16"),
            p + "mlp.up_proj.weight": ((i, h), "BF16"),
            p + "mlp.down_proj.weight": ((h, i), "BF16"),
        }
    out |= {"model.norm.weight": ((h,), "BF16"), "lm_head.weight": ((v, h), "BF16")}
    return out


def test_llama_70b_header_at_world_size_256(tmp_path):
    path = write_header_only(tmp_path / "70b.safetensors", llama_70b_tensors())
    doc = inspect_json(path, "-n", "256")
    assert doc["params"]["total_count"] == 723
    assert doc["params"]["total_numel"] == 68_976_648_192
    assert len(doc["buffers"]) == 81 and len(doc["units"]) == 80
    per_layer = 2 * 8192 + 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672
    assert doc["memory"]["largest_unit_bytes"] == 2 * per_layer  # bf16, no padding needed
    flat = doc["memory"]["schemes"][1]
    # 16 bytes per element, 1/256 each, plus two gathered and two gradient layers
    assert flat["persistent"] == pytest.approx(16 * 68_976_648_192 / 256, rel=1e-4)
    assert flat["gather"] == flat["reduce"] == 4 * per_layer
    table = invoke(path, "-n", "256").stdout
    assert "+79 more buffers with this layout" in table
    assert len(table.splitlines()) < 250  # folded: two buffer tables, two shard maps


# ---------------------------------------------------------------- errors


def test_filter_matching_nothing_lists_what_exists():
    msg = failure(LLAMA, "--filter", "name:*.experts.*")
    assert "filter 'name:*.experts.*' matches no parameter" in msg
    assert "names like" in msg and "model.layers.N" in msg and "dtypes bf16" in msg


def test_module_kind_filter_without_architecture_says_how_to_give_one():
    msg = failure(LLAMA, "--filter", "linear")
    assert "needs the model's architecture" in msg and "--model package.module:factory" in msg


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--filter", "kind:linear"], "cannot parse filter 'kind:linear'"),
        (["--filter", "re:("], "bad regular expression"),
        (["--filter", "min-numel:x"], "min-numel takes a whole number"),
        (["--exclude", "type:Linear"], "needs the model's architecture"),
        (["--align", "sideways"], "--align 'sideways' is not yafsdp|fsdp|megatron|none"),
        (["--format", "yaml"], "--format 'yaml' is not one of table | json | markdown"),
        (["--optimizer", "lamb"], "--optimizer 'lamb' is not one of adamw"),
        (["--param-dtype", "fp12"], "unknown dtype 'fp12'"),
        (["--param-dtype", "int8"], "--param-dtype 'int8' is not a floating-point dtype"),
        (["--grad-dtype", "nope"], "unknown dtype 'nope'"),
        (["--unit", "decoder.*"], "--unit 'decoder.*' matches no module; modules look like"),
    ],
)
def test_usage_errors(args, message):
    assert message in failure(LLAMA, *args)


def test_world_size_must_be_positive():
    result = invoke(LLAMA, "--world-size", "0")
    assert result.exit_code == 2 and "--world-size" in result.output


def test_names_fold_in_the_middle_at_80_columns_never_mid_word():
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("yafsdp")
    env = {**os.environ, "COLUMNS": "80"}
    argv = [str(exe), "inspect", str(SAMPLES / "llama.safetensors"), "-n", "8"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80
    names = [e["name"] for b in inspect_json(SAMPLES / "llama.safetensors")["buffers"]
             for e in b["entries"]]  # fmt: skip
    cells = [c.strip() for line in lines if line.startswith("│") for c in line.split("│")]
    for name in names[:9]:  # the buffers shown (identical blocks fold to the first)
        shown = [c for c in cells if c == name or ("…" in c and name.startswith(c.split("…")[0])
                 and name.endswith(c.split("…")[1]))]  # fmt: skip
        assert shown, f"{name} is neither whole nor folded in the middle:\n{out}"
    full = subprocess.run([*argv, "--all"], env={**env, "COLUMNS": "200"}, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    assert all(n in full for n in names)  # --all shows every name in full
