"""``profile --fake`` against the real step on transformers models at training lengths,
MoE included; the peak by module; the position limit; ``--checkpointing``.

Every case profiles the same model for real and fake and asks for the same bytes:
the whole step's peak, its breakdown, each phase's peak and what is left after the
step, for the original and the converted model. The kernels match (the fake step
takes the real step's path, see ``profiling/fake.py``), so equality is to the byte.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")
from hf_models import VOCAB, tiny_config  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
ARCH = {
    "t5": "T5ForConditionalGeneration",
    "bert": "BertForMaskedLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
}


# Narrower than tests/hf_models.py: attention at 4096 tokens costs seq^2 x hidden.
NARROW = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1)
INTER = NARROW["intermediate_size"]


def config(name: str, dtype: str, **overrides):
    if name == "qwen2":  # tied embedding, biased q/k/v projections
        cfg = tf.Qwen2Config(
            vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=True, **NARROW
        )
    elif name == "gpt2":
        cfg = tiny_config(name)
        cfg.n_embd, cfg.n_head = NARROW["hidden_size"], NARROW["num_attention_heads"]
    else:
        cfg = tiny_config(name)  # mixtral: transformers 5's fused experts (grouped_mm)
        for key, value in NARROW.items():
            setattr(cfg, key, value)
        cfg.head_dim = NARROW["hidden_size"] // NARROW["num_attention_heads"]
    cfg.architectures = [ARCH[name]]
    cfg.dtype = dtype
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def folder(tmp_path, name: str, dtype: str = "float32", **overrides):
    """A config-only Hugging Face folder: the real run builds it with random weights,
    the fake one from the meta device."""
    path = tmp_path / f"{name}-{dtype}"
    config(name, dtype, **overrides).save_pretrained(path)
    return path


def real_and_fake(path, **kw):
    real = profile_model(load_source(path), options(ProfileOptions, fake=False, **kw))
    fake = profile_model(load_source(path), options(ProfileOptions, fake=True, **kw))
    return real, fake


def assert_same_step(real, fake):
    for a, b in ((real.original, fake.original), (real.converted_step, fake.converted_step)):
        assert a.peak == b.peak, a.variant
        assert a.phase_peaks == b.phase_peaks, a.variant
        assert a.end == b.end, a.variant
        assert a.peak_phase == b.peak_phase, a.variant
        assert a.peak_modules == b.peak_modules, a.variant


# Every model at 128 tokens and at the longest it takes; fp32 and bf16, checkpointing
# on and off, one and two ranks, spread so each model sees each (GPT-2's position
# table ends at 1024; its attention dropout takes the CPU's math path).
CASES = [
    ("llama", 128, "float32", "none", 1),
    ("llama", 2048, "bfloat16", "non-reentrant", 2),
    ("llama", 4096, "bfloat16", "none", 1),
    ("qwen2", 128, "bfloat16", "reentrant", 1),
    ("qwen2", 2048, "float32", "none", 1),
    ("qwen2", 4096, "float32", "non-reentrant", 2),
    ("gpt2", 128, "bfloat16", "non-reentrant", 2),
    ("gpt2", 1024, "float32", "none", 1),
    ("mixtral", 128, "float32", "reentrant", 1),
    ("mixtral", 2048, "bfloat16", "none", 2),
    ("mixtral", 4096, "bfloat16", "non-reentrant", 1),
    ("t5", 128, "float32", "non-reentrant", 1),  # relative position buckets from real positions
    ("bert", 512, "bfloat16", "none", 2),  # its position table's end
]


@pytest.mark.parametrize(("name", "tokens", "dtype", "ckpt", "world_size"), CASES)
def test_fake_step_equals_real_step(tmp_path, name, tokens, dtype, ckpt, world_size):
    overrides = {"n_positions": 1024} if name == "gpt2" else {}
    path = folder(tmp_path, name, dtype, **overrides)
    real, fake = real_and_fake(
        path, batch=1, seq_len=tokens, checkpointing=ckpt, world_size=world_size
    )
    assert_same_step(real, fake)
    assert real.original.peak.activations > 0
    assert real.inputs.startswith(f"input_ids (1, {tokens}) int64")


def test_checkpointing_keeps_fewer_activations(tmp_path):
    """With every layer checkpointed the forward keeps each layer's input only (fake
    equals real with and without it: the cases above)."""
    path = folder(tmp_path, "llama", "bfloat16")
    plain = profile_model(load_source(path), options(ProfileOptions, batch=1, seq_len=512))
    ckpt = profile_model(
        load_source(path),
        options(ProfileOptions, batch=1, seq_len=512, checkpointing="non-reentrant"),
    )
    assert ckpt.original.phase_peaks["forward"] < plain.original.phase_peaks["forward"]
    assert "activation_checkpointing_enable" in " ".join(ckpt.notes)


@pytest.mark.parametrize("name", ["gpt", "llama", "moe"])
def test_sample_models_with_checkpointing(name):
    def run(**kw):
        loaded = load_source(
            f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}"
        )
        return profile_model(loaded, options(ProfileOptions, batch=1, seq_len=64, **kw))

    real, fake = run(checkpointing="non-reentrant"), run(checkpointing="non-reentrant", fake=True)
    assert_same_step(real, fake)
    assert real.original.phase_peaks["forward"] < run().original.phase_peaks["forward"]


def test_checkpointing_without_units_is_an_error():
    with pytest.raises(YafsdpError, match="no repeated blocks to checkpoint.*--unit"):
        profile_model(
            load_source("sample_models/mlp.safetensors", model="sample_models.models:mlp"),
            options(ProfileOptions, checkpointing="non-reentrant"),
        )


def test_peak_by_module_names_the_swiglu_activations(tmp_path):
    """At a bf16 Llama's peak (the end of the forward) each layer keeps, for backward,
    SiLU's input (gate_proj's output), SiLU's output and up_proj's output (the product's
    operands) and the product (down_proj's input): (tokens, intermediate) bf16 each;
    lm_head's logits are alive too. Fake and real agree row by row."""
    path = folder(tmp_path, "llama", "bfloat16")
    tokens = 512
    real, fake = real_and_fake(path, batch=1, seq_len=tokens, modules=50, loss="projection")
    assert_same_step(real, fake)
    step = real.original
    assert step.peak_phase == "forward"
    rows = {m.name: m for m in step.peak_modules}
    layers, inter = 2, INTER
    for name in ("mlp.gate_proj", "mlp.act_fn", "mlp.up_proj", "mlp"):
        row = rows[f"model.layers.*.{name}"]
        assert (row.count, row.bytes) == (layers, layers * tokens * inter * 2), name
    assert rows["lm_head"].bytes == tokens * VOCAB * 2
    assert rows["model.layers.*.mlp.act_fn"].kind == "SiLUActivation"
    sizes = [m.bytes for m in step.peak_modules]
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) <= step.peak.activations
    opts = options(ProfileOptions, batch=1, seq_len=tokens, modules=3, fake=True, loss="projection")
    assert profile_model(load_source(path), opts).original.peak_modules == step.peak_modules[:3]


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize(
    ("name", "tokens", "limit"),
    [
        ("gpt2", 32, "16 positions (config n_positions)"),  # IndexError in wpe
        ("bert", 600, "512 positions (config max_position_embeddings)"),  # a buffer of 512
    ],
)
def test_sequence_longer_than_the_position_table(tmp_path, fake, name, tokens, limit):
    path = folder(tmp_path, name)
    with pytest.raises(YafsdpError, match=rf"--seq-len {tokens} is longer .*{re.escape(limit)}"):
        profile_model(
            load_source(path), options(ProfileOptions, batch=1, seq_len=tokens, fake=fake)
        )


def test_position_limit_from_the_cli_is_one_line(tmp_path):
    path = folder(tmp_path, "gpt2")
    for extra in ([], ["--fake"]):
        result = runner.invoke(app, ["profile", str(path), "--seq-len", "17", *extra])
        assert result.exit_code == 2, result.output
        assert "--seq-len 17 is longer than GPT2LMHeadModel takes" in result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_rotary_models_run_past_max_position_embeddings(tmp_path):
    """max_position_embeddings of a rotary model is its training length, not a limit."""
    path = folder(tmp_path, "llama", max_position_embeddings=64)
    real, fake = real_and_fake(path, batch=1, seq_len=128)
    assert_same_step(real, fake)


def test_moe_fake_runs_in_float32_and_bfloat16(tmp_path):
    """torch's meta kernel for _grouped_mm takes bf16 only; the fake step's takes what
    the CPU kernel takes."""
    for dtype in ("float32", "bfloat16"):
        path = folder(tmp_path, "mixtral", dtype)
        fake = profile_model(load_source(path), options(ProfileOptions, fake=True, seq_len=32))
        assert fake.converted_step.peak.total > 0


def test_cuda_target_keeps_no_attention_matrix(tmp_path):
    """GPT-2 trains with attention dropout: the CPU's sdpa takes the math path and keeps
    at least the (batch, heads, seq, seq) float32 probabilities of every layer; CUDA's
    mem-efficient kernel (float32) keeps a (batch, heads, seq) log-sum-exp instead."""
    path = folder(tmp_path, "gpt2", n_positions=1024)
    kw = dict(fake=True, batch=1, seq_len=1024)
    cpu = profile_model(load_source(path), options(ProfileOptions, **kw))
    cuda = profile_model(load_source(path), options(ProfileOptions, target="cuda", **kw))
    assert cuda.kernels == {"efficient": 4}  # 2 layers, original and converted
    layers, heads = 2, NARROW["num_attention_heads"]
    dropped = cpu.original.peak.activations - cuda.original.peak.activations
    assert dropped >= layers * heads * 1024 * 1024 * 4


def test_cuda_target_needs_fake_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU message")
    result = runner.invoke(
        app, ["profile", "--model", "sample_models.models:gpt", "--target", "cuda"]
    )
    assert result.exit_code == 2, result.output
    assert "--target cuda on the CPU needs --fake" in result.output
