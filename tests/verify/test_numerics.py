"""A mismatch means a conversion bug: both runs pinned, and the original re-checked.

Each condition that changes the numbers without a conversion bug is forced here (a
thread count changed between the runs, OpenMP's dynamic adjustment under load), and
shown to give a wrong verdict without its remedy and the right one with it. A planted
conversion bug is still a mismatch; a planted nondeterministic original is "not
reproducible", never a mismatch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import options
from typer.testing import CliRunner

import yafsdp_cli.engine.flat as flat_engine
import yafsdp_cli.verify.numerics as numerics
import yafsdp_cli.verify.single as verify_single
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source
from yafsdp_cli.verify import VerifyOptions, verify_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def loaded(name: str):
    return load_source(f"sample_models/{name}.safetensors", model=f"sample_models.models:{name}")


def _layernorm_bias_grad(threads: int) -> torch.Tensor:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(32)
    x = torch.randn(64, 32, requires_grad=True)
    (ln(x) * torch.randn(64, 32)).sum().backward()
    return ln.bias.grad.clone()


def test_the_cause_gradients_depend_on_the_thread_count():
    """LayerNorm's CPU backward sums each thread's rows in its own buffer: the last bit
    of a bias gradient follows the thread count, while the forward does not."""
    before = torch.get_num_threads()
    try:
        assert not torch.equal(_layernorm_bias_grad(1), _layernorm_bias_grad(2))
        assert torch.equal(_layernorm_bias_grad(2), _layernorm_bias_grad(2))
    finally:
        torch.set_num_threads(before)


def _threads_flip_at_conversion(monkeypatch):
    """Something in the process changes the thread count between the two runs."""
    real = verify_single.convert_module

    def convert(module, layout):
        torch.set_num_threads(3 - torch.get_num_threads())  # 1 <-> 2
        return real(module, layout)

    monkeypatch.setattr(verify_single, "convert_module", convert)


@pytest.mark.parametrize("remedy", [True, False])
def test_a_thread_count_changed_between_the_runs(monkeypatch, remedy):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    _threads_flip_at_conversion(monkeypatch)
    if not remedy:  # no pinning before the converted model's run
        monkeypatch.setattr(verify_single, "apply", lambda threads: None)
    try:
        report = verify_model(loaded("gpt"), options(VerifyOptions, steps=1))
    finally:
        torch.set_num_threads(before)
    if remedy:
        assert report.ok and report.reproducible, report.first_failure
    else:
        # the condition changes the numbers: without pinning the run cannot pass
        assert not report.ok
        assert report.first_failure.name.endswith("ln_1.bias")


FAKE_LOADAVG = r"""
#include <stdio.h>
#include <stdlib.h>
/* getloadavg from a file the test writes: the load an OpenMP runtime sees */
int getloadavg(double l[], int n) {
  double x = 0;
  FILE *f = fopen(getenv("FAKE_LOADAVG_FILE"), "r");
  if (f) { if (fscanf(f, "%lf", &x) != 1) x = 0; fclose(f); }
  for (int i = 0; i < n; i++) l[i] = x;
  return n;
}
"""

UNDER_LOAD = textwrap.dedent(
    """
    import json, os, sys, torch
    sys.path.insert(0, {root!r})
    import yafsdp_cli.verify.numerics as numerics
    import yafsdp_cli.verify.single as single
    from yafsdp_cli.sources import load_source
    from yafsdp_cli.verify import VerifyOptions, verify_model

    if sys.argv[1] == "off":  # no remedy: dynamic adjustment stays as the environment says
        numerics.set_omp_dynamic = lambda on: False
    torch.set_num_threads(2)
    real = single.convert_module

    def convert(module, layout):  # the machine gets busy between the two runs
        with open(os.environ["FAKE_LOADAVG_FILE"], "w") as f:
            f.write("1.5")
        return real(module, layout)

    single.convert_module = convert
    src = load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")
    r = verify_model(src, VerifyOptions(steps=1))
    print(json.dumps({{"ok": r.ok, "reproducible": r.reproducible, "pinned": r.pinned}}))
    """
)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the load shim")
@pytest.mark.parametrize("remedy", ["on", "off"])
def test_openmp_dynamic_adjustment_under_load(tmp_path, remedy):
    """OMP_DYNAMIC=true: GNU OpenMP sizes each team as the CPUs less the load average,
    so a load that rises between the two runs halves the team of the converted run."""
    shim = tmp_path / "libfakeload.so"
    (tmp_path / "fake.c").write_text(FAKE_LOADAVG)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", shim, tmp_path / "fake.c"], check=True)
    load = tmp_path / "load"
    load.write_text("0")
    script = tmp_path / "run.py"
    script.write_text(UNDER_LOAD.format(root=str(ROOT)))
    env = {**os.environ, "OMP_DYNAMIC": "true", "LD_PRELOAD": str(shim),
           "FAKE_LOADAVG_FILE": str(load)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, script, remedy], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if remedy == "on":
        assert result["ok"], result
        assert "OpenMP" in result["pinned"]
    else:
        assert not result["ok"], result


def test_pinned_gives_the_callers_settings_back():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    numerics.set_omp_dynamic(True)
    try:
        with numerics.pinned(2) as pins:
            assert torch.get_num_threads() == 2
            assert numerics.omp_dynamic() is False
            assert torch.are_deterministic_algorithms_enabled()
        assert pins.threads == 2 and pins.omp_dynamic_off and pins.deterministic
        assert torch.get_num_threads() == 1
        assert numerics.omp_dynamic() is True
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        numerics.set_omp_dynamic(False)
        torch.set_num_threads(before)


def test_the_report_states_what_it_pinned():
    threads = torch.get_num_threads()
    result = runner.invoke(app, ["verify", "--model", "sample_models.models:mlp", "--json"])
    assert result.exit_code == 0, result.output
    pinned = json.loads(result.stdout)["report"]["pinned"]
    assert f"{threads} thread" in pinned and "dynamic thread adjustment off" in pinned
    result = runner.invoke(app, ["verify", "--model", "sample_models.models:mlp"])
    assert "numerics" in result.output and "deterministic" in result.output


@pytest.mark.parametrize("shift", [1, 3, 16])
def test_the_flat_buffers_alignment_does_not_change_the_numbers(monkeypatch, shift):
    """A flat buffer whose base is 4, 12 or 64 bytes off its allocation's start: the
    converted model's views then sit on other alignments than the original's
    parameters, and the numbers are still bit for bit the same."""
    real_zeros = torch.zeros

    def zeros(n, dtype=None, device=None):
        return real_zeros(n + shift, dtype=dtype, device=device)[shift:]

    monkeypatch.setattr(flat_engine, "torch", _torch_with(zeros))
    for name in ("gpt", "llama"):
        report = verify_model(loaded(name), options(VerifyOptions, steps=1))
        assert report.ok, (name, report.first_failure)


def _torch_with(zeros):
    class Torch:
        def __getattr__(self, name):
            return zeros if name == "zeros" else getattr(torch, name)

    return Torch()


NONDETERMINISTIC = """
import random

from torch import nn

class Drifting(nn.Module):
    '''Noise from a generator verify does not seed: no two runs give the same output.'''

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + 1e-3 * random.random()

def build():
    return Drifting()
"""


def test_a_nondeterministic_original_is_not_a_mismatch(tmp_path):
    factory = tmp_path / "drifting.py"
    factory.write_text(NONDETERMINISTIC)
    result = runner.invoke(app, ["verify", "--model", f"{factory}:build", "--json"])
    assert result.exit_code == 3, result.output
    rep = json.loads(result.stdout)["report"]
    assert rep["reproducible"] is False and rep["drift"]["name"] == "output (micro-batch 0)"
    result = runner.invoke(app, ["verify", "--model", f"{factory}:build"])
    assert result.exit_code == 3
    assert "NOT REPRODUCIBLE" in result.output and "MISMATCH" not in result.output


def test_a_real_conversion_bug_is_still_a_mismatch_after_the_recheck(monkeypatch):
    real = verify_single.convert_module

    def convert(module, layout):
        flat = real(module, layout)
        with torch.no_grad():
            flat.buffers[0].param.data[0] += 1e-3  # one element of the converted weights
        return flat

    monkeypatch.setattr(verify_single, "convert_module", convert)
    result = runner.invoke(app, ["verify", "--model", "sample_models.models:mlp", "--json"])
    assert result.exit_code == 1, result.output
    rep = json.loads(result.stdout)["report"]
    assert rep["reproducible"] is True and rep["failures"] > 0


@pytest.mark.slow
def test_two_ranks_recheck_a_nondeterministic_original(tmp_path):
    factory = tmp_path / "drifting.py"
    factory.write_text(NONDETERMINISTIC)
    argv = ["verify", "--model", f"{factory}:build", "--world-size", "2", "--steps", "1",
            "--json"]  # fmt: skip
    result = runner.invoke(app, argv)
    assert result.exit_code == 3, result.output
    assert json.loads(result.stdout)["report"]["reproducible"] is False
