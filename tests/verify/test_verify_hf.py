"""verify and profile on Hugging Face folders: tied (GPT-2), shared four ways and
encoder-decoder (T5), bf16 (Llama), mixture of experts (Mixtral), encoder (BERT)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine.train_step import make_batch
from yafsdp_cli.options import StepOptions
from yafsdp_cli.profiling import ProfileOptions, profile_source
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import VerifyOptions, verify_model
from yafsdp_cli.verify.dist import run_world

tf = pytest.importorskip("transformers")
from hf_models import CLASSES, VOCAB, tiny_model  # noqa: E402

pytestmark = pytest.mark.hf
runner = CliRunner()


def _tiny(name: str):
    model = tiny_model(name)
    return model.to(torch.bfloat16) if name == "llama" else model


CONFIGS = {name: (lambda name=name: _tiny(name)) for name in CLASSES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, make in CONFIGS.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(name)
        make().save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_verify_matches_exactly_in_one_process(folders, name):
    report = verify_model(load_source(folders[name]), options(VerifyOptions, steps=2))
    assert report.ok, report.first_failure
    assert report.memory[0].ok


def test_inputs_follow_the_config(folders):
    t5 = load_source(folders["t5"]).build_module()
    batch = make_batch(t5, StepOptions(batch=3, seq_len=5))
    assert set(batch.kwargs) == {"input_ids", "decoder_input_ids", "use_cache"}
    assert batch.kwargs["input_ids"].shape == (3, 5) and batch.kwargs["use_cache"] is False
    assert int(batch.kwargs["decoder_input_ids"].max()) < VOCAB
    bert = load_source(folders["bert"]).build_module()
    assert set(make_batch(bert).kwargs) == {"input_ids"}


def test_verify_matches_on_two_ranks(folders):
    """Tied, shared-four-ways + encoder-decoder, and bf16, in one launch."""
    names = ("gpt2", "t5", "llama", "mixtral")
    jobs = [
        (str(folders[n]), None, False, options(VerifyOptions, world_size=2, steps=2)) for n in names
    ]
    for name, report in zip(names, run_world(jobs)):
        assert report.ok, (name, report.first_failure)
        assert all(m.ok for m in report.memory), name


@pytest.mark.parametrize("name", ["gpt2", "t5", "bert"])
def test_fake_profile_equals_the_real_one(folders, name):
    real = profile_source(folders[name], opts=options(ProfileOptions, world_size=2))
    fake = profile_source(folders[name], opts=options(ProfileOptions, world_size=2, fake=True))
    assert real.original.peak == fake.original.peak
    assert real.converted_step.peak == fake.converted_step.peak
    assert real.converted_step.peak.total < real.original.peak.total


def test_fake_profile_of_mixtral_equals_the_real_one(folders):
    """transformers 5 runs Mixtral's experts with torch._grouped_mm, whose own fake
    kernel (torch 2.13) takes only bfloat16; the fake step's takes what the CPU kernel
    takes (profiling/kernels.py)."""
    docs = []
    for extra in ([], ["--fake"]):
        result = runner.invoke(app, ["profile", str(folders["mixtral"]), "--json", *extra])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    for variant in ("original", "converted"):
        assert docs[0][variant]["peak"] == docs[1][variant]["peak"], variant
