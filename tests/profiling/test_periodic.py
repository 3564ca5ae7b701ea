"""A fake step traced for one period of the layer stack and repeated equals the step
traced whole: the same peak, phase peaks, breakdowns, end of step, op count and
replayed reserved peak; and where the layers are not periodic, the whole model is
traced and the report says why."""

from __future__ import annotations

import pytest
from helpers import options

from yafsdp_cli.memory.caching_allocator import reserved_of
from yafsdp_cli.options import LayoutOptions, StepOptions
from yafsdp_cli.options.alloc_conf import allocator_setting
from yafsdp_cli.profiling import ProfileOptions
from yafsdp_cli.profiling.layer_stack import _period, find_stack
from yafsdp_cli.profiling.profiler import profile_model
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")

from hf_models import deepseek_v3_shape  # noqa: E402 - after the skip


def _folder(tmp_path, config) -> str:
    folder = tmp_path / "model"
    config.save_pretrained(folder)
    return str(folder)


def _llama(layers: int = 8):
    return tf.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _both(source, **step):
    """The report traced one period and repeated, and the one traced whole."""
    ws = step.pop("world_size", 1)
    out = []
    for periodic in (True, False):
        opts = ProfileOptions(
            layout=LayoutOptions(world_size=ws),
            step=options(StepOptions, batch=2, seq_len=16, **step),
            fake=True,
            periodic=periodic,
        )
        traces: dict = {}
        out.append((profile_model(load_source(source), opts, traces=traces), traces))
    return out


def _assert_same(periodic, whole) -> None:
    (a, ta), (b, tb) = periodic, whole
    for v in ("original", "converted_step"):
        x, y = getattr(a, v), getattr(b, v)
        assert x.peak == y.peak, v
        assert x.peak_phase == y.peak_phase, v
        assert x.phase_peaks == y.phase_peaks, v
        assert x.phase_breakdowns == y.phase_breakdowns, v
        assert x.end == y.end, v
        assert x.ops == y.ops, v
    conf = allocator_setting(None)
    for v in ("original", "converted"):
        assert reserved_of(ta[v], conf).reserved_peak == reserved_of(tb[v], conf).reserved_peak
    assert (a.flat_buffers, a.converted, a.kept) == (b.flat_buffers, b.converted, b.kept)


@pytest.mark.parametrize(
    "step",
    [
        {},
        {"world_size": 4},
        {"checkpointing": "non-reentrant"},
        {"checkpointing": "reentrant", "world_size": 2},
        {"target": "cuda", "world_size": 8},
        {"param_dtype": "bf16", "world_size": 2},
    ],
    ids=["plain", "sharded", "non-reentrant", "reentrant-sharded", "cuda", "bf16-masters"],
)
def test_llama_periodic_equals_whole(tmp_path, step):
    periodic, whole = _both(_folder(tmp_path, _llama()), **step)
    _assert_same(periodic, whole)
    assert whole[0].trace.periodic is False
    # the converted step (what plan measures) is repeated wherever it is periodic
    assert periodic[0].trace.traced_layers == ((3, 4) if periodic[0].trace.periodic else (8,))


def test_llama_cpu_step_is_repeated(tmp_path):
    periodic, _ = _both(_folder(tmp_path, _llama(10)))
    how = periodic[0].trace
    assert how.periodic, how.why
    assert how.traced_layers == (3, 4)
    assert "checked event for event" in how.why


def test_alternating_attention_has_period_two(tmp_path):
    config = tf.Gemma2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
    )
    source = _folder(tmp_path, config)
    loaded = load_source(source)
    stack = find_stack(loaded.module)
    assert (stack.prefix, stack.period) == (0, 2)
    periodic, whole = _both(source)
    _assert_same(periodic, whole)


def test_moe_with_dense_layers_between(tmp_path):
    config = tf.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
    )
    source = _folder(tmp_path, config)
    stack = find_stack(load_source(source).module)
    assert stack.period == 2
    periodic, whole = _both(source)
    _assert_same(periodic, whole)


@pytest.mark.parametrize("step", [{}, {"world_size": 4, "target": "cuda"}], ids=["plain", "cuda"])
def test_dense_first_layers_are_a_prefix(tmp_path, step):
    config = deepseek_v3_shape(16)
    source = _folder(tmp_path, config)
    stack = find_stack(load_source(source).module)
    assert (stack.prefix, stack.period) == (2, 1)
    periodic, whole = _both(source, **step)
    assert periodic[0].trace.periodic, periodic[0].trace.why
    assert periodic[0].trace.traced_layers == (5, 6)
    _assert_same(periodic, whole)


def _both_module(factory):
    out = []
    for periodic in (True, False):
        opts = ProfileOptions(step=StepOptions(batch=2, seq_len=8), fake=True, periodic=periodic)
        out.append(profile_model(load_source(None, model=factory), opts))
    return out


def test_a_planted_layer_that_differs_is_traced_whole():
    # layer 3 is inside the checked depth (4): the check sees it differ
    periodic, whole = _both_module("stack_models:odd_at_3")
    how = periodic.trace
    assert not how.periodic
    assert "is not the traced step of 4" in how.why
    assert how.traced_layers == (12,)
    assert periodic.converted_step.peak == whole.converted_step.peak
    assert periodic.original.peak == whole.original.peak


def test_a_factory_model_is_repeated_and_exact():
    periodic, whole = _both_module("stack_models:regular")
    assert periodic.trace.periodic, periodic.trace.why
    for v in ("original", "converted_step"):
        assert getattr(periodic, v).peak == getattr(whole, v).peak
        assert getattr(periodic, v).phase_peaks == getattr(whole, v).phase_peaks


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("aaaaaaaa", (0, 1)),
        ("abababab", (0, 2)),
        ("xaaaaaaaaa", (1, 1)),
        ("aaaaab" * 5, (0, 6)),
        ("aaaaabaaaaab", (12, 12)),  # no period short enough to gain
        ("xyabababababab", (2, 2)),
    ],
)
def test_period_of_signatures(pattern, expected):
    assert _period(list(pattern)) == expected


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "mixtral", "bert"])
@pytest.mark.parametrize("step", [{}, {"checkpointing": "reentrant", "world_size": 2}])
def test_the_test_architectures_deepened_are_repeated_exactly(tmp_path, name, step):
    """The Hugging Face models of the tests, 10 layers deep so that a period is worth
    repeating: the repeated step equals the whole trace. T5's two stacks (an encoder
    and a decoder) are not cut together: its check finds the step not periodic, and
    it is traced whole."""
    from hf_models import tiny_config

    config = tiny_config(name)
    for key in ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"):
        if getattr(config, key, None) == 2:
            setattr(config, key, 10)
    periodic, whole = _both(_folder(tmp_path, config), **step)
    _assert_same(periodic, whole)
    how = periodic[0].trace
    assert how.periodic == (name != "t5"), how.why
