"""QLoRA's step time: a 4-bit base is dequantized to its dtype in every forward and
again in every backward (for the input's gradient), as bitsandbytes' ``MatMul4Bit``
does, by memory-bound kernels that read the packed codes and the absmax scales and
write the weight. The step with ``--quantize`` is LoRA's step plus exactly those
kernels, which the test works out by hand from the model's weight shapes and the
format (two codes a byte, one float32 absmax per block of 64; nested: the absmax as
uint8 codes in blocks of 256), and the adapter's own products are in both."""

from __future__ import annotations

import math

import pytest
from helpers import options

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.options import LayoutOptions, StepOptions
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.sources import load_source
from yafsdp_cli.sources.adapted import adapt
from yafsdp_cli.timing import count_step, estimate_step, gpu_spec
from yafsdp_cli.timing.roofline import efficiency_for

tf = pytest.importorskip("transformers")
pytest.importorskip("peft")

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 2048, 5632, 16, 4, 2
BATCH, SEQ, RANK = 2, 128, 8
LORA = f"r={RANK},targets=q_proj,v_proj"
GPU = gpu_spec("h100-sxm")
DEQUANT = ("yafsdp.dequantize_4bit.default", "yafsdp.dequantize_blockwise.default")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Llama config stored in bfloat16 (no weights: the step is counted fake)."""
    config = tf.LlamaConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, torch_dtype="bfloat16",
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path_factory.mktemp("llama-bf16")
    config.save_pretrained(path)
    return str(path)


def _step(folder, **step):
    opts = ProfileOptions(
        step=options(
            StepOptions, batch=BATCH, seq_len=SEQ, target="cuda", param_dtype="bf16", **step
        ),
        fake=True,
    )
    loaded = adapt(load_source(folder), opts.step)
    costs = count_step(loaded, opts)
    layout = plan(loaded.spec, LayoutOptions(world_size=1))
    return costs, estimate_step(costs, layout, GPU)


def _weights() -> dict[str, tuple[int, int]]:
    """Each layer's frozen linear weights (out, in): the ones quantized."""
    kv = HIDDEN // HEADS * KV_HEADS
    return {
        "q_proj": (HIDDEN, HIDDEN), "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN),
        "o_proj": (HIDDEN, HIDDEN), "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
        "down_proj": (HIDDEN, INTER),
    }  # fmt: skip


def _kernel_s(elements: int, nbytes: int) -> float:
    """The roofline by hand: a kernel of one vector FLOP per element of its larger side."""
    eff = efficiency_for(GPU)
    memory = nbytes / (GPU.hbm_bytes_per_s * eff.memory)
    vector = elements / (GPU.fp32_flops * eff.vector)
    return max(memory, vector) + eff.kernel_floor_s


def _dequantize_s(shape: tuple[int, int], nested: bool) -> tuple[float, float]:
    """(seconds, of which bytes over bandwidth) of one dequantization of a weight."""
    eff = efficiency_for(GPU)
    n = math.prod(shape)
    blocks = -(-n // 64)
    # the 4-bit kernel: packed codes and float32 absmax in, the bfloat16 weight out
    kernels = [(n, n // 2 + 4 * blocks + 2 * n)]
    if nested:  # the absmax first: uint8 codes, their absmax and 256-entry table in
        nested_blocks = -(-blocks // 256)
        read = blocks + 4 * nested_blocks + 4 * 256
        kernels.insert(0, (blocks + nested_blocks + 256, read + 4 * blocks))
        kernels.insert(1, (blocks + 1, 4 * blocks + 4 + 4 * blocks))  # absmax += offset
    seconds = sum(_kernel_s(e, b) for e, b in kernels)
    return seconds, sum(b for _, b in kernels) / (GPU.hbm_bytes_per_s * eff.memory)


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq"])
def test_a_quantized_base_adds_its_dequantization_forward_and_backward(folder, kind):
    lora_costs, lora = _step(folder, lora=LORA)
    costs, quantized = _step(folder, lora=LORA, quantize=kind)
    nested = kind.endswith("-dq")
    forward = backward = memory = 0.0
    dequantized = 0  # weights dequantized in the step
    for layer in range(LAYERS):
        for name, shape in _weights().items():
            seconds, over_bandwidth = _dequantize_s(shape, nested)
            forward += seconds
            memory += over_bandwidth
            dequantized += 1
            # backward dequantizes for the input's gradient; layer 0's q, k and v
            # projections read the frozen embedding's output, which needs none
            if layer > 0 or name not in ("q_proj", "k_proj", "v_proj"):
                backward += seconds
                memory += over_bandwidth
                dequantized += 1
    added = quantized.step_s - lora.step_s
    assert quantized.forward_s - lora.forward_s == pytest.approx(forward, rel=1e-9)
    assert quantized.backward_s - lora.backward_s == pytest.approx(backward, rel=1e-9)
    assert added == pytest.approx(forward + backward, rel=1e-9)
    # every dequantization kernel is bound by its bytes: the time added is their bytes
    # over the bandwidth plus one launch floor per kernel
    launches = dequantized * (3 if nested else 1)
    floor = efficiency_for(GPU).kernel_floor_s
    assert added == pytest.approx(memory + launches * floor, rel=1e-9)
    # the dequantization adds no products; the rest of the step is LoRA's
    for phase in ("forward", "backward"):
        assert costs.phase(phase).matrix_flops == lora_costs.phase(phase).matrix_flops
    kept = [o for o in costs.ops if not o.name.startswith(DEQUANT) and o.name != "aten.add_.Tensor"]
    lora_ops = [o for o in lora_costs.ops if o.name != "aten.add_.Tensor"]
    assert [(o.name, o.bytes) for o in kept] == [(o.name, o.bytes) for o in lora_ops]


def test_the_adapter_products_are_counted(folder):
    """Each adapted layer's forward adds x @ A (in -> r) and that @ B (r -> out)."""
    base, _ = _step(folder)
    lora, _ = _step(folder, lora=LORA)
    tokens = BATCH * SEQ
    adapter = sum(
        2 * tokens * RANK * (shape[0] + shape[1])
        for name, shape in _weights().items()
        if name in ("q_proj", "v_proj")
    )
    assert lora.phase("forward").model_flops - base.phase("forward").model_flops == LAYERS * adapter
    assert lora.phase("backward").model_flops > 0
