"""A check that never cries wolf: the same answer every run, ranks that exit clean.

What can flake is run many times here: a model with dropout under varied hash seeds,
thread counts and allocation patterns (in new processes and in this one), and the
torchrun line of docs/verify.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import options

from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import VerifyOptions, verify_model

tf = pytest.importorskip("transformers")
from hf_models import tiny_model  # noqa: E402

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def gpt2_with_dropout(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    assert model.config.attn_pdrop == model.config.resid_pdrop == 0.1  # dropout is on
    model.save_pretrained(folder)
    return folder


def _run(argv: list[str], env_extra: dict, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, cwd=cwd, timeout=300)


# hash seeds, thread counts and glibc allocation patterns (perturbed fills, arena counts,
# no mmap reuse) that change where every tensor lands and how work is split
CONDITIONS = [
    {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"},
    {"PYTHONHASHSEED": "1", "OMP_NUM_THREADS": "2", "MALLOC_PERTURB_": "165"},
    {"PYTHONHASHSEED": "2", "OMP_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "1"},
    {"PYTHONHASHSEED": "3", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "4096"},
    {"PYTHONHASHSEED": "random", "OMP_NUM_THREADS": "2", "MALLOC_TOP_PAD_": "1"},
    {"PYTHONHASHSEED": "4242", "OMP_NUM_THREADS": "2", "MALLOC_PERTURB_": "7"},
]


def test_dropout_model_is_bit_exact_in_every_process(gpt2_with_dropout):
    argv = ["yafsdp", "verify", str(gpt2_with_dropout), "--filter", "linear",
            "--optimizer", "sgd", "--json"]  # fmt: skip
    for env in CONDITIONS:
        done = _run(argv, env)
        assert done.returncode == 0, (env, done.stdout[-2000:], done.stderr[-2000:])
        doc = json.loads(done.stdout)["report"]
        assert doc["ok"] and doc["failures"] == 0, env
        assert all(d["max_abs"] == 0 for d in doc["worst"]), env


def test_dropout_model_is_bit_exact_run_after_run_in_one_process(gpt2_with_dropout):
    loaded = load_source(str(gpt2_with_dropout))
    opts = options(VerifyOptions, filters=("linear",), optimizer="sgd", steps=2)
    keep = []
    for i in range(12):
        torch.set_num_threads(1 + i % 2)
        keep.append(torch.empty(4099 * (i + 1)))  # another allocation pattern each run
        report = verify_model(loaded, opts)
        assert report.ok and report.failures == 0, (i, report.first_failure)
        assert not any("random numbers" in n for n in report.notes)
    torch.set_num_threads(max(1, os.cpu_count() or 1))


def test_a_model_that_draws_differently_is_named(monkeypatch):
    """Verify says when the converted model drew other random numbers, not only that
    its outputs differ."""
    import yafsdp_cli.verify.single as single

    real = single.convert_module

    def convert(module, layout):
        flat = real(module, layout)
        module.register_forward_pre_hook(lambda *_: torch.rand(1) and None)  # one more draw
        return flat

    monkeypatch.setattr(single, "convert_module", convert)
    report = verify_model(load_source(None, model="sample_models.models:mlp"), VerifyOptions())
    assert any("drew a different amount of random numbers" in n for n in report.notes)


@pytest.mark.skipif(shutil.which("torchrun", path=str(BIN)) is None, reason="no torchrun")
def test_the_readme_torchrun_line_exits_clean_every_time(tmp_path):
    """docs/verify.md: torchrun --nproc-per-node 2 --no-python yafsdp verify SOURCE --world-size 2
    (repeated 50 times by ``python -m benchmarks.run torchrun_exit``)."""
    root = Path(__file__).resolve().parents[2]
    argv = ["torchrun", "--nproc-per-node", "2", "--no-python", "yafsdp", "verify",
            str(root / "sample_models/gpt.safetensors"), "--model", "sample_models.models:gpt",
            "--world-size", "2", "--steps", "1"]  # fmt: skip
    for _ in range(3):
        done = _run(argv, {"OMP_NUM_THREADS": "1"}, cwd=root)
        assert done.returncode == 0, done.stderr[-3000:]
        # rank 0 alone prints: one report, its verdict first and again at its end
        assert done.stdout.count("yafsdp verify") == 1, done.stdout
        assert done.stdout.count("OK: converted model matches") == 2, done.stdout
        assert "terminate called" not in done.stderr and "SIGABRT" not in done.stderr


@pytest.mark.slow
def test_two_runs_side_by_side_beside_a_busy_core_all_pass(gpt2_with_dropout):
    """The repetition benchmark's harshest one-rank series, small: two verify loops at
    once and a busy process pinned to one core (``python -m benchmarks.run
    verify_repeat`` runs 200 one-rank and 30 two-rank verifies)."""
    from benchmarks.bench_verify_repeat import run_series

    verdicts = run_series(gpt2_with_dropout, runs=2, loops=2, ranks=1, busy=True)
    assert verdicts == ["ok"] * 4, verdicts
