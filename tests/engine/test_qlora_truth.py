"""``--quantize`` against bitsandbytes itself, where it is installed (it is not a
dependency: ``pip install bitsandbytes``; these tests are skipped without it).

bitsandbytes 0.50 runs its 4-bit and LLM.int8() layers on the CPU, so a real QLoRA
step runs here: a transformers Llama (hidden 256, 2 layers, vocabulary 96) stored in
bfloat16, loaded with ``BitsAndBytesConfig`` (4-bit ``nf4``/``fp4``, nested or not,
bfloat16 compute; or 8-bit), peft's LoRA on ``q_proj``/``v_proj``, the model's own
loss, AdamW over the adapter. Every quantized layer must hold exactly the bytes
``packed.packed_parts`` gives, and ``profile --fake --lora --quantize`` must give the
step's peak storage bytes, counted by the profiler's tracker, within 3%.
"""

from __future__ import annotations

import pytest
import torch
from helpers import options

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (not a dependency)")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import bitsandbytes as bnb  # noqa: E402

from yafsdp_cli.engine.packed import packed_bytes  # noqa: E402
from yafsdp_cli.engine.train_step import optimizer_tensors  # noqa: E402
from yafsdp_cli.profiling import ProfileOptions, StorageTracker, profile_model  # noqa: E402
from yafsdp_cli.sources import load_source  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
KINDS = ("nf4", "nf4-dq", "fp4", "int8")
LORA, TARGETS = "r=4,alpha=8,targets=q_proj,v_proj", ["q_proj", "v_proj"]
BATCH, TOKENS, VOCAB = 2, 64, 96
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A bfloat16 Llama folder with random weights."""
    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16",
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    folder = tmp_path_factory.mktemp("llama-bf16")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _load(folder, kind: str):
    if kind == "int8":
        config = tf.BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = tf.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=kind.removesuffix("-dq"),
            bnb_4bit_use_double_quant=kind.endswith("-dq"),
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    return tf.LlamaForCausalLM.from_pretrained(
        folder, quantization_config=config, device_map="cpu", dtype=torch.bfloat16
    )


def _quantized(model) -> list:
    return [m for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]


def _packed_tensors(layer) -> list[torch.Tensor]:
    """The weight's storage and every tensor bitsandbytes keeps beside it: the 4-bit
    quant state (absmax, code table; nested: their absmax, code table and offset) or
    LLM.int8()'s row scales."""
    w = layer.weight
    state = getattr(w, "quant_state", None)
    if state is None:
        return [w, w.SCB]
    out = [w, state.absmax, state.code]
    if state.nested:
        out += [state.state2.absmax, state.state2.code, state.offset]
    return out


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _real_step_peak(model) -> int:
    """One step after a warm-up one (the optimizer's state exists), measured as
    ``test_finetune`` measures its peft step, the packed tensors counted as held."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    tracker = StorageTracker(1)
    tracker.assign(list(model.parameters()), "parameters")
    tracker.assign([t for m in _quantized(model) for t in _packed_tensors(m)], "parameters")
    tracker.assign(list(model.buffers()), "buffers")
    tracker.assign(optimizer_tensors(opt), "optimizer")
    tracker.assign([ids], "activations")
    with tracker:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker.replay([]).peak.total


@pytest.mark.parametrize("kind", KINDS)
def test_every_quantized_layer_holds_the_packed_bytes(stored, kind):
    layers = _quantized(_load(stored, kind))
    assert len(layers) == 14  # 7 projections a layer; the output head stays as it is
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        assert _storage_bytes(_packed_tensors(layer)) == packed_bytes(kind, shape), shape


@pytest.mark.parametrize("kind", KINDS)
def test_real_qlora_step_against_profile_fake(stored, kind):
    torch.manual_seed(0)
    model = peft.get_peft_model(
        _load(stored, kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    )
    model.train()
    real = _real_step_peak(model)
    opts = options(ProfileOptions, fake=True, seq_len=TOKENS, batch=BATCH, lora=LORA, quantize=kind)
    planned = profile_model(load_source(stored), opts).original.peak.total
    print(f"{kind}: profile / real {planned / real:.4f} ({planned} / {real})")
    assert abs(planned / real - 1) <= TOLERANCE, (kind, planned, real)
