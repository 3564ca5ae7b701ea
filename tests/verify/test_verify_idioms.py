"""`yafsdp verify --checkpointing` and `--compile`: every sample, on 1 and 2 ranks."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import SAMPLE_NAMES
from helpers import options
from torch._inductor.utils import run_and_get_code
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import VerifyOptions, verify_model
from yafsdp_cli.verify import single as verify_single
from yafsdp_cli.verify.dist import run_world
from yafsdp_cli.verify.numerics import pinned

runner = CliRunner()
MODES = ("reentrant", "non-reentrant")
# the samples without repeated blocks get their units named, as a user would with --unit
UNITS = {"mlp": ("net.*",), "cnn": ("features.*",)}


def loaded(name):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def job(name: str, **opts) -> tuple:
    source, model = f"sample_models/{name}.safetensors", f"sample_models.models:{name}"
    return (source, model, False, options(VerifyOptions, units=UNITS.get(name), **opts))


@pytest.mark.parametrize("mode", MODES)
def test_every_sample_under_checkpointing(sample_name, mode):
    opts = options(VerifyOptions, checkpointing=mode, steps=2, units=UNITS.get(sample_name))
    report = verify_model(loaded(sample_name), opts)
    assert report.ok, report.first_failure
    assert all(d.max_abs == 0 for d in report.worst)
    assert any("activation checkpointing" in n for n in report.notes), report.notes


@pytest.fixture(scope="module")
def two_rank_idioms():
    """Every sample under each checkpointing mode on 2 ranks, in one launch."""
    keys = [(n, m) for m in MODES for n in SAMPLE_NAMES]
    jobs = [job(n, world_size=2, steps=2, checkpointing=m) for n, m in keys]
    return dict(zip(keys, run_world(jobs)))


@pytest.mark.parametrize("mode", MODES)
def test_every_sample_under_checkpointing_on_two_ranks(two_rank_idioms, sample_name, mode):
    report = two_rank_idioms[(sample_name, mode)]
    assert report.ok, report.first_failure
    assert report.world_size == 2


def test_every_sample_compiled():
    for name in SAMPLE_NAMES:
        report = verify_model(loaded(name), options(VerifyOptions, compile=True, steps=2))
        assert report.ok, (name, report.first_failure)
        assert any("torch.compile" in n for n in report.notes)


def _compiled_embedding_backward_code() -> str:
    """The kernels inductor generates for a compiled embedding's forward and backward."""
    torch._dynamo.reset()
    emb = torch.nn.Embedding(50, 8)
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    fn = torch.compile(lambda i: emb(i).pow(2).sum())
    _, codes = run_and_get_code(lambda: fn(ids).backward())
    torch._dynamo.reset()
    return "\n".join(codes)


def test_why_compiled_verify_needs_deterministic_kernels():
    # The flake this guards against: with several threads, inductor sums an embedding's
    # gradient with atomic adds (order, and so the last bit, varies run to run); in
    # deterministic mode it calls ATen's serial kernel instead.
    assert not torch.are_deterministic_algorithms_enabled()
    assert "atomic_add" in _compiled_embedding_backward_code()
    with pinned():
        assert "atomic_add" not in _compiled_embedding_backward_code()
    assert not torch.are_deterministic_algorithms_enabled()  # the setting is given back


@pytest.mark.parametrize("compile_", [True, False])
def test_verify_runs_both_models_deterministically(monkeypatch, compile_):
    seen = []
    real = verify_single.forward_backward

    def spy(model, batch, seed):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(model, batch, seed)

    monkeypatch.setattr(verify_single, "forward_backward", spy)
    report = verify_model(loaded("gpt"), options(VerifyOptions, compile=compile_, steps=1))
    assert report.ok, report.first_failure
    assert len(seen) == 4  # two micro-batches on each model
    assert seen == [True] * 4  # both models, eager or compiled
    assert "deterministic algorithms on" in report.pinned
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's setting back


def test_compiled_and_checkpointed_on_two_ranks_through_the_cli():
    argv = [
        "verify",
        "sample_models/gpt.safetensors",
        "--model",
        "sample_models.models:gpt",
        "--world-size",
        "2",
        "--compile",
        "--checkpointing",
        "non-reentrant",
        "--steps",
        "2",
    ]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "torch.compile" in result.output and "2 ranks" in result.output
    words = " ".join(re.sub("[│┃]", " ", result.output).split())  # table cells wrap
    assert "deterministic algorithms on" in words


def test_an_unknown_mode_is_one_line_and_exit_2():
    argv = ["verify", "--model", "sample_models.models:mlp", "--checkpointing", "sometimes"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert "--checkpointing 'sometimes' is not one of none|reentrant|non-reentrant" in result.output


def test_a_model_without_units_says_how_to_give_them():
    result = runner.invoke(
        app, ["verify", "--model", "sample_models.models:mlp", "--checkpointing", "reentrant"]
    )
    assert result.exit_code == 2, result.output
    assert "no repeated blocks to checkpoint; name them with --unit" in result.output
