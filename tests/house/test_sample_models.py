"""The committed sample checkpoints are what `python -m sample_models.build` makes."""

from __future__ import annotations

import hashlib

import torch
from conftest import SAMPLES

from sample_models.build import main as build_all


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_cnn(rebuilt, committed) -> None:
    """The CNN's weights bit for bit; its BatchNorm statistics, which come from a
    float32 convolution forward, to float32 rounding: the CPU's convolution kernel
    (oneDNN picks one per instruction set) sums in its own order, so an AMD and an
    Intel machine differ in the last bits of the running means."""
    from safetensors.torch import load_file

    a, b = load_file(rebuilt), load_file(committed)
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)
        else:
            assert torch.equal(a[k], b[k]), k


def test_rebuild_gives_the_committed_checkpoints(tmp_path):
    build_all(tmp_path)
    rebuilt = sorted(p.name for p in tmp_path.iterdir())
    assert rebuilt == sorted(
        p.name for p in SAMPLES.iterdir() if p.suffix in (".safetensors", ".pt")
    )
    for name in rebuilt:
        if name == "cnn.safetensors":
            _same_cnn(tmp_path / name, SAMPLES / name)
        elif name.endswith(".safetensors"):  # byte for byte
            assert digest(tmp_path / name) == digest(SAMPLES / name), name
    for name in ("mlp.pt", "gpt.pt"):  # the same tensors (zip metadata may differ by version)
        a = torch.load(tmp_path / name, weights_only=True)
        b = torch.load(SAMPLES / name, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
