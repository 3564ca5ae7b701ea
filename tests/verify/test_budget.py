"""verify knows its peak before it allocates, keeps one model alive at a time, and
checks real blocks of a model too large to check whole."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

import yafsdp_cli.verify.run_plan as run_plan
from tests import verify_side_by_side
from yafsdp_cli import YafsdpError
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import MemoryBudgetError, VerifyOptions, verify_model
from yafsdp_cli.verify.blocks import parse_blocks, spread
from yafsdp_cli.verify.budget import Available, available_memory, cgroup_available
from yafsdp_cli.verify.harness import prepare
from yafsdp_cli.verify.single import run_single

runner = CliRunner()


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def _limit(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(run_plan, "available_memory", lambda: Available(nbytes, "test limit"))


# -- knowing before allocating ---------------------------------------------------------


def test_a_run_that_cannot_fit_is_refused_in_one_line(monkeypatch):
    _limit(monkeypatch, 2**20)
    result = runner.invoke(
        app, ["verify", "sample_models/llama.safetensors", "--model", "sample_models.models:llama"]
    )
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert "verify needs about" in line and "1.00 MiB (test limit) is available" in line
    assert "parameters 209.50 KiB" in line  # what it needs, in parts


def test_the_refusal_comes_before_the_model_is_built(monkeypatch):
    _limit(monkeypatch, 2**20)
    source = loaded("gpt")
    monkeypatch.setattr(type(source), "build_module", lambda self: pytest.fail("built"))
    with pytest.raises(MemoryBudgetError, match=r"verify needs about [\d,]+ B but 1,048,576 B"):
        verify_model(source, VerifyOptions())


def test_rlimit_as_is_read_in_a_limited_process():
    # a real address-space limit 160 MiB above what the process maps now: the margin
    # alone does not fit, so verify must refuse (exit 2) instead of dying in malloc
    code = textwrap.dedent(
        """
        import resource, sys
        import torch, safetensors.torch, sample_models.models
        import yafsdp_cli.verify, yafsdp_cli.report.verify_view, yafsdp_cli.cli.verify_cmd
        from yafsdp_cli.cli import app
        size = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1])
        limit = size * 1024 + 160 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        sys.argv = ['yafsdp', 'verify', 'sample_models/gpt.safetensors',
                    '--model', 'sample_models.models:gpt']
        app()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "(RLIMIT_AS) is available" in done.stderr and "Traceback" not in done.stderr


def test_cgroup_limits_are_read(tmp_path):
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("600000\n")
    (tmp_path / "memory.stat").write_text("anon 1\ninactive_file 100000\n")
    assert cgroup_available(tmp_path) == 500_000
    (tmp_path / "memory.max").write_text("max\n")
    assert cgroup_available(tmp_path) is None
    assert available_memory().bytes > 0


def test_the_estimate_is_in_the_report_beside_the_measured_peak():
    report = verify_model(loaded("mlp"), options(VerifyOptions, steps=1))
    assert report.ok and report.budget is not None and report.budget.fits
    est = report.budget.estimate
    assert est.params > 0 and est.grads == est.params and est.optimizer == 2 * est.params
    assert est.activations > 0  # the meta forward ran
    assert report.peak_rss > 0


# -- one model at a time: the same report as side by side ------------------------------


def _comparable(report):
    """Without what only the sequential run reports (its estimate, peak and pins)."""
    assert report.pinned.startswith("pinned: ") or not report.pinned
    return dataclasses.replace(report, budget=None, peak_rss=0, pinned="")


def test_sequential_equals_side_by_side_on_every_sample(sample_name):
    opts = options(VerifyOptions, steps=2, top=1000)
    new = run_single(prepare(loaded(sample_name), opts), opts)
    old = verify_side_by_side.run_single(prepare(loaded(sample_name), opts), opts)
    assert _comparable(new) == _comparable(old)
    assert new.ok and new.compared > 0


def test_a_steps_gradients_are_freed_before_the_next_backward(monkeypatch):
    """The original's gradients of one step, once on disk, are dropped before the next
    step's backward makes new ones (held, they were a second set of gradients at the
    peak: GPT-2 124M peaked at 3.34 GiB instead of 2.85)."""
    import weakref

    import yafsdp_cli.verify.single as single

    stored: list[weakref.ref] = []
    alive_at_backward: list[int] = []
    real_save, real_fb = single.ReferenceStore.save_step, single.forward_backward

    def save_step(self, step, parts):
        real_save(self, step, parts)
        grads = parts.get("gradient", {})
        stored.extend(weakref.ref(g) for g in grads.values() if g is not None)

    def forward_backward(*args, **kwargs):
        alive_at_backward.append(sum(r() is not None for r in stored))
        return real_fb(*args, **kwargs)

    monkeypatch.setattr(single.ReferenceStore, "save_step", save_step)
    monkeypatch.setattr(single, "forward_backward", forward_backward)
    loaded = load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")
    report = verify_model(loaded, options(VerifyOptions, steps=3))
    assert report.ok and stored
    assert alive_at_backward and max(alive_at_backward) == 0, alive_at_backward


def test_sequential_equals_side_by_side_on_a_failure(monkeypatch):
    from tests.verify.test_verify import _split_tie

    _split_tie(monkeypatch)
    monkeypatch.setattr(verify_side_by_side, "convert_module", fit_convert())
    opts = options(VerifyOptions, steps=2, top=1000)
    new = run_single(prepare(loaded("gpt"), opts), opts)
    old = verify_side_by_side.run_single(prepare(loaded("gpt"), opts), opts)
    assert not new.ok and new.failures > 0
    assert _comparable(new) == _comparable(old)


def fit_convert():
    import yafsdp_cli.verify.single as single

    return single.convert_module  # the split-tie conversion _split_tie installed


# -- --blocks ------------------------------------------------------------------------


@pytest.fixture
def tied_llama(tmp_path):
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    model = tf.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", model


def test_blocks_keep_real_weights_and_the_tie(tied_llama):
    path, model = tied_llama
    opts = options(VerifyOptions, steps=2, blocks="0,3", top=1000)
    module = prepare(load_source(str(path)), opts).original
    assert len(module.model.layers) == 2
    assert module.lm_head.weight is module.model.embed_tokens.weight  # the tie survives
    want = model.model.layers[3].mlp.up_proj.weight
    assert torch.equal(module.model.layers[1].mlp.up_proj.weight, want)
    assert torch.equal(module.model.embed_tokens.weight, model.model.embed_tokens.weight)
    report = verify_model(load_source(str(path)), opts)
    assert report.ok, report.first_failure
    assert report.blocks.kept == (0, 3) and report.blocks.total == 4
    names = {(d.kind, d.name) for d in report.worst}
    assert ("gradient", "lm_head.weight") in names
    assert ("gradient", "model.embed_tokens.weight") in names


def test_the_most_blocks_that_fit_are_chosen(tied_llama, monkeypatch):
    path, _ = tied_llama
    source, opts = load_source(str(path)), options(VerifyOptions, steps=1)
    big = Available(2**50, "x")
    two, three = (
        run_plan.budget_for(
            source, opts, big, run_plan.BlockChoice(spread(k, 4), 4, "model.layers", "")
        )
        for k in (2, 3)
    )
    _limit(monkeypatch, (two.estimate.total + three.estimate.total) // 2)
    result = runner.invoke(app, ["verify", str(path), "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    blocks = __import__("json").loads(result.stdout)["report"]["blocks"]
    assert blocks["kept"] == [0, 3] and "the most blocks that fit" in blocks["why"]
    assert "blocks: 0, 3 of 4 in model.layers" in " ".join(result.stderr.split())  # wrapped


def test_blocks_spec_errors():
    assert parse_blocks("2", 32) == (0, 31)
    assert parse_blocks("0,17,31", 32) == (0, 17, 31)
    assert parse_blocks("all", 3) == (0, 1, 2)
    assert spread(3, 5) == (0, 2, 4)
    with pytest.raises(YafsdpError, match="the model has 4 blocks; give 1 to 4"):
        parse_blocks("5", 4)
    with pytest.raises(YafsdpError, match="9 is not a block index"):
        parse_blocks("0,9", 4)
    with pytest.raises(YafsdpError, match="give a count"):
        parse_blocks("first", 4)


def test_blocks_on_a_factory_without_a_depth_argument_is_a_clear_error():
    result = runner.invoke(
        app,
        ["verify", "sample_models/gpt.safetensors", "--model", "sample_models.models:gpt"]
        + ["--blocks", "1"],
    )
    assert result.exit_code == 2
    assert "has no depth to change" in result.output


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--filter", "no.such.parameter"],
        ["--input-shape", "3,3"],
        ["--input-shape", "3,3", "--world-size", "2"],
    ],
    ids=["no-architecture", "filters-select-nothing", "forward-fails", "forward-fails-on-ranks"],
)
def test_no_estimate_is_printed_before_an_error(extra):
    """A source verify cannot run (a state dict without its model, a filter that
    selects nothing, a forward that fails inside the run, in one process or on its
    ranks) is its error alone: the estimate line is for a run that has a verdict."""
    args = ["verify", "sample_models/mlp.pt"]
    if extra:
        args += ["--model", "sample_models.models:mlp", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    assert "estimated peak" not in result.output


def test_the_estimate_is_printed_for_a_run_that_goes_ahead():
    result = runner.invoke(
        app,
        ["verify", "sample_models/mlp.pt", "--model", "sample_models.models:mlp", "--steps", "1"],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("verify: estimated peak"), result.stderr
