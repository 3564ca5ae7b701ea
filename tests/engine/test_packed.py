"""The packed storage of bitsandbytes' formats, on hand-worked cases, and a quantized
(QLoRA) base in the fake step, in plan and in check."""

from __future__ import annotations

import json

import pytest
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.engine.packed import packed_bytes, packed_parts
from yafsdp_cli.options import StepOptions
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

runner = CliRunner()


# 4096 x 4096 = 16,777,216 elements; 262,144 blocks of 64
@pytest.mark.parametrize(
    ("kind", "shape", "expected"),
    [
        # codes 8,388,608 + float32 absmax 1,048,576 + the 16-entry table 64
        ("nf4", (4096, 4096), 8_388_608 + 1_048_576 + 64),
        ("fp4", (4096, 4096), 8_388_608 + 1_048_576 + 64),
        # codes + uint8 absmax 262,144 + 1,024 nested float32 absmax (4,096) + the
        # table 64 + the offset 4 + the nested 256-entry table 1,024
        ("nf4-dq", (4096, 4096), 8_388_608 + 262_144 + 4_096 + 64 + 4 + 1_024),
        # int8 weight 16,777,216 + 4,096 float32 row scales
        ("int8", (4096, 4096), 16_777_216 + 16_384),
        # 15 elements: 8 bytes of codes (one half empty), one block's absmax, the table
        ("nf4", (3, 5), 8 + 4 + 64),
        ("int8", (3, 5), 15 + 12),
        # 65 elements: 33 bytes of codes, two blocks; nested: one block of absmax
        ("nf4-dq", (5, 13), 33 + 2 + 4 + 64 + 4 + 1_024),
    ],
)
def test_packed_bytes_by_hand(kind, shape, expected):
    assert packed_bytes(kind, shape) == expected


def test_packed_weight_is_the_first_part_in_bnb_shapes():
    assert packed_parts("nf4", (4096, 4096))[0].shape == (8_388_608, 1)  # Params4bit
    assert packed_parts("int8", (8, 4))[0].shape == (8, 4)


def test_unknown_kind_is_one_clear_error():
    with pytest.raises(YafsdpError, match="--quantize 'nf3': choose one of nf4, nf4-dq"):
        StepOptions(quantize="nf3")


tf = pytest.importorskip("transformers")
pytest.importorskip("peft")
from hf_models import tiny_config  # noqa: E402

LORA = "r=4,alpha=8,targets=q_proj,v_proj"
# the tiny Llama's frozen linear weights (the output head stays unpacked): per layer
# q 32x32, k 16x32, v 16x32, o 32x32, gate/up 64x32, down 32x64; two layers
LINEARS = [(32, 32), (16, 32), (16, 32), (32, 32), (64, 32), (64, 32), (32, 64)] * 2


@pytest.fixture
def llama(tmp_path):
    cfg = tiny_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.torch_dtype = "float32"  # stored, so the plan keeps it (dtype-less sources plan bf16)
    cfg.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def fake(path, **kw):
    opts = options(ProfileOptions, fake=True, seq_len=32, lora=LORA, **kw)
    return profile_model(load_source(path), opts)


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq", "int8"])
def test_quantized_base_holds_its_packed_bytes(llama, kind):
    plain, packed = fake(llama), fake(llama, quantize=kind)
    full = sum(4 * o * i for o, i in LINEARS)  # float32 as stored
    parts = [packed_parts(kind, s) for s in LINEARS]
    weights = sum(p[0].nbytes for p in parts)
    beside = sum(q.nbytes for p in parts for q in p[1:])
    a, b = plain.original.peak, packed.original.peak
    assert a.parameters - b.parameters == full - weights
    assert b.buffers - a.buffers == beside
    assert b.optimizer == a.optimizer  # the adapter alone trains either way
    assert any(
        n.startswith("estimated, not measured: 14 frozen linear layers") for n in packed.notes
    )


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq"])
def test_a_16_bit_step_keeps_the_scales_in_their_format(llama, kind):
    """Training in bfloat16 casts every floating buffer to it, but not a quantized
    base's absmax scales: bitsandbytes keeps them float32 whatever the compute dtype."""
    plain, packed = (fake(llama, param_dtype="bfloat16", **q) for q in ({}, {"quantize": kind}))
    parts = [packed_parts(kind, s) for s in LINEARS]
    beside = sum(q.nbytes for p in parts for q in p[1:])
    assert any(q.dtype == "float32" for p in parts for q in p[1:])  # the case this is for
    assert packed.original.peak.buffers - plain.original.peak.buffers == beside


def test_quantize_without_fake_says_so(llama):
    result = runner.invoke(app, ["profile", str(llama), "--lora", LORA, "--quantize", "nf4"])
    assert result.exit_code == 2, result.output
    assert "fake steps only; add --fake" in result.output


def test_quantize_with_nothing_frozen_is_an_error(llama):
    with pytest.raises(YafsdpError, match="no frozen linear layer to pack"):
        profile_model(load_source(llama), options(ProfileOptions, fake=True, quantize="nf4"))


def test_plan_and_check_take_quantize(llama, tmp_path):
    args = ["plan", str(llama), "--gpu-memory", "4GiB", "--world-size", "1", "--jobs", "1"]
    args += ["--micro-batch", "1,2", "--seq-len", "32", "--checkpointing", "none", "--json"]
    plain = runner.invoke(app, [*args, "--lora", LORA])
    packed = runner.invoke(app, [*args, "--lora", LORA, "--quantize", "nf4"])
    assert plain.exit_code == 0 and packed.exit_code == 0, packed.output
    a = json.loads(plain.stdout)["rows"][0]["breakdown"]
    b = json.loads(packed.stdout)["rows"][0]["breakdown"]
    assert b["params"] < a["params"] / 2  # 4-bit codes for most of the model
    assert any("estimated, not measured" in n for n in json.loads(packed.stdout)["notes"])
    baseline = tmp_path / "b.json"
    made = runner.invoke(
        app,
        [
            "check",
            str(llama),
            "-b",
            str(baseline),
            "--update",
            "--lora",
            LORA,
            "--quantize",
            "nf4",
            "--seq-len",
            "32",
        ],
    )
    assert made.exit_code == 0, made.output
    assert json.loads(baseline.read_text())["inputs"]["quantize"] == "nf4"
    again = runner.invoke(app, ["check", str(llama), "-b", str(baseline)])
    assert again.exit_code == 0, again.output


def test_packed_layer_saves_only_what_the_plain_layer_saves(llama):
    """The 4-bit stand-in saves nothing of its own for backward: the step's activations
    are those of the unquantized step."""
    plain, packed = fake(llama), fake(llama, quantize="nf4")
    assert packed.original.peak.activations == plain.original.peak.activations


def test_int8_layer_keeps_its_input_for_backward(llama):
    """LLM.int8()'s matmul keeps its input on the autograd context, so activations an
    unquantized step frees (a projection's input no other op saves) stay alive."""
    plain, packed = fake(llama), fake(llama, quantize="int8")
    assert packed.original.peak.activations > plain.original.peak.activations
