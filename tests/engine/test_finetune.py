"""Fine-tuning steps: ``--freeze`` and ``--lora`` in profile, check and plan.

The truth cases train a real peft model (``peft.get_peft_model`` on a tiny transformers
Llama, the model's own loss, AdamW over what requires grad) and a real model with
frozen layers, measured with the tracker profile uses, against ``profile --fake``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.engine.finetune import LoraSettings, parse_lora
from yafsdp_cli.engine.train_step import optimizer_tensors
from yafsdp_cli.options import StepOptions
from yafsdp_cli.profiling import ProfileOptions, StorageTracker, profile_model
from yafsdp_cli.sources import load_source

tf = pytest.importorskip("transformers")
from hf_models import tiny_config  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_thread")]
runner = CliRunner()
LORA = "r=4,alpha=8,targets=q_proj,v_proj"
BATCH, TOKENS = 2, 64


@pytest.fixture
def llama(tmp_path):
    """A config-only Llama folder: random weights for real steps, meta for fake ones.

    The config stores float32, the dtype the real steps train in, so the fake step
    plans the same dtype rather than plan's bfloat16 default for dtype-less sources."""
    cfg = tiny_config("llama")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.torch_dtype = "float32"
    cfg.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def fake(path, **kw):
    return profile_model(
        load_source(path), options(ProfileOptions, fake=True, seq_len=TOKENS, **kw)
    )


# --lora's text


def test_lora_text_parses():
    assert parse_lora("r=16,alpha=32,targets=q_proj,v_proj") == LoraSettings(
        16, 32.0, ("q_proj", "v_proj")
    )
    after = parse_lora("r=8,targets=q_proj,k_proj,dropout=0.1")
    assert after == LoraSettings(8, 8.0, ("q_proj", "k_proj"), 0.1)
    assert parse_lora("r=8,targets=all-linear").alpha == 8.0  # peft's default: alpha = r


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("r=16,alpha=32", "names no targets"),
        ("", "has no rank"),
        ("alpha=32,targets=q_proj", "no rank"),
        ("r=x,targets=q_proj", "r=.x. is not a whole number"),
        ("r=0,targets=q_proj", "r=0 must be at least 1"),
        ("r=4,beta=2,targets=q_proj", "cannot read 'beta=2'"),
        ("r=4,targets=", "names no targets"),
        ("r=4,q_proj", "cannot read 'q_proj'"),
        (5, "--lora 5 is not text"),  # a baseline's recorded inputs
    ],
)
def test_bad_lora_text_is_one_clear_error(text, match):
    with pytest.raises(YafsdpError, match=match):
        StepOptions(lora=text)


def test_bad_freeze_expression_fails_in_the_options():
    with pytest.raises(YafsdpError, match="cannot parse filter"):
        StepOptions(freeze=("nonsense",))


# --freeze


def test_freeze_drops_gradients_and_optimizer_state(llama):
    whole = fake(llama)
    frozen = fake(llama, freeze=("embedding",))
    embed = 96 * 32 * 4  # the embedding's float32 bytes
    # AdamW keeps two float32 states per trained element and a 0-d float32 step per
    # tensor; the embedding has none now
    assert whole.original.peak.optimizer - frozen.original.peak.optimizer == 2 * embed + 4
    assert whole.original.peak.parameters == frozen.original.peak.parameters
    assert whole.original.peak.gradients == frozen.original.peak.gradients == 0  # freed
    converted = whole.converted_step.peak.optimizer - frozen.converted_step.peak.optimizer
    assert 2 * embed <= converted <= 2 * embed + 64  # the root buffer's padding moves


def test_freeze_matching_nothing_lists_what_exists(llama):
    with pytest.raises(YafsdpError, match=r"--freeze 'name:nope\*' matches no parameter; "):
        fake(llama, freeze=("name:nope*",))


def test_frozen_parameters_train_in_no_dtype(llama):
    """--param-dtype casts a frozen layer with the rest (it computes with them) but
    gives it no float32 master and no states."""
    step = fake(llama, freeze=("embedding",), param_dtype="bf16")
    cast = fake(llama, param_dtype="bf16")
    embed = 96 * 32
    assert step.original.peak.parameters == cast.original.peak.parameters
    # the master (4 B) and two float32 states per element, and the master's 0-d step
    assert cast.original.peak.optimizer - step.original.peak.optimizer == 3 * 4 * embed + 4


def test_lora_base_keeps_its_stored_dtype(llama):
    """Under LoRA the base is loaded as stored (float32 here) whatever --param-dtype
    says; only the adapter is cast, with float32 masters."""
    stored = fake(llama, lora=LORA)
    bf16 = fake(llama, lora=LORA, param_dtype="bf16")
    adapter = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    assert stored.original.peak.parameters - bf16.original.peak.parameters == 2 * adapter


# --lora


def test_lora_trains_only_the_adapter(llama):
    whole = fake(llama)
    lora = fake(llama, lora=LORA)
    # q_proj (32 -> 32) and v_proj (32 -> 16) in 2 layers, rank 4: A (4, in) + B (out, 4)
    adapter = 2 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))
    step_counters = 4 * 4 * 2  # AdamW's 0-d float32 step per adapter tensor: 4 a layer
    assert lora.original.peak.optimizer == 2 * 4 * adapter + step_counters
    assert lora.original.peak.parameters == whole.original.peak.parameters + 4 * adapter
    assert lora.converted_step.peak.total < whole.converted_step.peak.total


@pytest.mark.parametrize("world_size", [1, 2])
def test_lora_fake_equals_real(llama, world_size):
    """At 2 ranks the frozen base and the adapter have flat buffers of their own in
    each unit; rank 0's step gathers both and reduces the adapter's gradients only."""
    opts = options(ProfileOptions, seq_len=TOKENS, lora=LORA, world_size=world_size)
    real = profile_model(load_source(llama), opts)
    fake_run = fake(llama, lora=LORA, world_size=world_size)
    assert real.flat_buffers == 5  # the root (frozen) and, per layer, frozen and adapter
    for a, b in (
        (real.original, fake_run.original),
        (real.converted_step, fake_run.converted_step),
    ):
        assert a.peak == b.peak, a.variant
        assert a.phase_peaks == b.phase_peaks, a.variant


def _real_step_peak(model, vocab: int) -> int:
    """One step as a fine-tuning script runs it (the model's own loss, AdamW over what
    requires grad, after a warm-up step so its state exists), measured by the tracker."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, vocab, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    tracker = StorageTracker(1)
    tracker.assign(list(model.parameters()), "parameters")
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


def test_real_peft_step_against_profile_fake(llama):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tiny_config("llama"))
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    model.train()
    real = _real_step_peak(model, base.config.vocab_size)
    planned = fake(llama, lora=LORA, batch=BATCH).original.peak.total
    assert abs(planned - real) <= 0.03 * real, (planned, real)


def test_real_frozen_step_against_profile_fake(llama):
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tiny_config("llama"))
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    real = _real_step_peak(model, model.config.vocab_size)
    frozen = ("embedding", "name:lm_head.*")
    planned = fake(llama, freeze=frozen, batch=BATCH).original.peak.total
    assert abs(planned - real) <= 0.03 * real, (planned, real)


# the command line


def test_profile_cli_takes_freeze_and_lora(llama):
    args = ["profile", str(llama), "--fake", "--seq-len", "32", "--json"]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0, plain.output
    tuned = runner.invoke(app, [*args, "--lora", LORA, "--freeze", "embedding"])
    assert tuned.exit_code == 0, tuned.output
    before, after = json.loads(plain.stdout), json.loads(tuned.stdout)
    assert after["original"]["peak"]["optimizer"] < before["original"]["peak"]["optimizer"]


def test_without_peft_lora_names_the_extra(llama, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    result = runner.invoke(app, ["profile", str(llama), "--fake", "--lora", LORA])
    assert result.exit_code == 2, result.output
    assert "pip install 'yafsdp-cli[peft]'" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_lora_target_that_is_absent_is_one_line(llama):
    result = runner.invoke(app, ["profile", str(llama), "--fake", "--lora", "r=4,targets=nope"])
    assert result.exit_code == 2, result.output
    assert "--lora 'r=4,targets=nope': " in result.output and "nope" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_check_records_freeze_and_lora(llama, tmp_path):
    baseline = tmp_path / "b.json"
    tuned = ["--freeze", "embedding", "--lora", LORA, "--seq-len", "32"]
    made = runner.invoke(app, ["check", str(llama), "-b", str(baseline), "--update", *tuned])
    assert made.exit_code == 0, made.output
    doc = json.loads(baseline.read_text())
    assert doc["inputs"]["freeze"] == ["embedding"] and doc["inputs"]["lora"] == LORA
    again = runner.invoke(app, ["check", str(llama), "-b", str(baseline), "--json"])
    assert again.exit_code == 0, again.output  # rebuilt from the baseline: same figures
    bigger = ["--lora", "r=16,targets=q_proj,k_proj,v_proj,o_proj"]
    # a tiny model's adapter: KiB, under the default byte floor
    whole = runner.invoke(
        app, ["check", str(llama), "-b", str(baseline), *bigger, "--min-bytes", "0"]
    )
    assert whole.exit_code == 1, whole.output  # a bigger adapter needs more: the gate fails


def test_plan_counts_gradients_and_states_of_the_adapter_only(llama, tmp_path):
    saved = {}

    def row(*extra):
        args = ["plan", str(llama), "--gpu-memory", "4GiB", "--world-size", "1"]
        args += ["--micro-batch", "1,2", "--seq-len", "32", "--checkpointing", "none"]
        result = runner.invoke(app, [*args, "--jobs", "1", "--json", *extra])
        assert result.exit_code == 0, result.output
        saved["plan"] = result.stdout
        return json.loads(result.stdout)["rows"][0]["breakdown"]

    full, lora = row(), row("--lora", LORA)
    plan_doc = tmp_path / "plan.json"
    plan_doc.write_text(saved["plan"])
    again = runner.invoke(app, ["check", "--baseline", str(plan_doc)])  # plans again, with --lora
    assert again.exit_code == 0 and "still fits (2 checked)" in again.output, again.output
    trained = ("grads", "optimizer", "master")
    # 896 adapter elements against 24,832 of the model: a few allocator rounds (512 B)
    # per flat buffer; AdamW's two float32 states per float32 master
    assert lora["master"] <= 4096 and lora["grads"] <= 4096, lora
    assert lora["optimizer"] == 2 * lora["master"], lora
    assert all(full[k] >= 49_000 for k in trained), full
    # the base stays float32 as stored; the full model trains (and is held) in bf16
    assert lora["params"] > 2 * full["params"] - 4096


# a PEFT adapter folder as the source


@pytest.fixture
def adapter(tmp_path):
    """A saved base (random weights) and a LoRA adapter over it, as peft saves one;
    its lora_B is 0.5 everywhere so a load is told apart from peft's zero init."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path / "base")
    base = tf.LlamaForCausalLM.from_pretrained(tmp_path / "base")
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter"


def test_adapter_folder_builds_with_its_weights(adapter):
    loaded = load_source(adapter)
    assert loaded.spec.source_kind == "peft"
    module = loaded.build_module()
    trained = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(bool((p == 0.5).all()) for n, p in trained.items() if "lora_B" in n)


def test_adapter_folder_profiles_as_lora_on_its_base(adapter):
    real = profile_model(load_source(adapter), options(ProfileOptions, seq_len=TOKENS))
    fake_run = fake(adapter)
    same = fake(adapter.parent / "base", lora=LORA)
    assert real.original.peak == fake_run.original.peak == same.original.peak
    assert real.converted_step.peak == fake_run.converted_step.peak


def test_adapter_folder_with_lora_is_an_error(adapter):
    with pytest.raises(YafsdpError, match="a PEFT adapter already; --lora would add a second"):
        fake(adapter, lora=LORA)


def test_adapter_over_a_hub_name_says_to_download(adapter):
    config = adapter / "adapter_config.json"
    doc = json.loads(config.read_text())
    doc["base_model_name_or_path"] = "meta-llama/Llama-3.1-8B"
    config.write_text(json.dumps(doc))
    result = runner.invoke(app, ["profile", str(adapter), "--fake"])
    assert result.exit_code == 2, result.output
    assert "'meta-llama/Llama-3.1-8B' is not a local folder" in result.output


def test_freeze_works_from_a_header_and_lora_needs_an_architecture(samples_dir):
    """``--freeze`` selects by name on a safetensors header alone; LoRA needs modules."""
    weights = str(samples_dir / "llama.safetensors")
    result = runner.invoke(app, ["inspect", weights, "--freeze", "name:*embed*", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["inputs"]["freeze"] == ["name:*embed*"] and doc["params"]["frozen_numel"] > 0
    plain = json.loads(runner.invoke(app, ["inspect", weights, "--json"]).stdout)
    ddp = {s["scheme"]: s for s in doc["memory"]["schemes"]}["ddp"]
    ddp_plain = {s["scheme"]: s for s in plain["memory"]["schemes"]}["ddp"]
    assert ddp["optimizer"] < ddp_plain["optimizer"] and ddp["params"] == ddp_plain["params"]
    lora = runner.invoke(app, ["inspect", weights, "--lora", LORA])
    assert lora.exit_code == 2, lora.output
    assert "LoRA and --quantize need the model's architecture" in lora.output
