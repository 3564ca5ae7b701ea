"""The committed sample checkpoints are what `python -m sample_models.build` makes."""

from __future__ import annotations

import hashlib

import torch
from conftest import SAMPLES

from sample_models.build import main as build_all


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_rebuild_gives_the_committed_checkpoints(tmp_path):
    build_all(tmp_path)
    rebuilt = sorted(p.name for p in tmp_path.iterdir())
    assert rebuilt == sorted(
        p.name for p in SAMPLES.iterdir() if p.suffix in (".safetensors", ".pt")
    )
    for name in rebuilt:
        if name.endswith(".safetensors"):  # byte for byte
            assert digest(tmp_path / name) == digest(SAMPLES / name), name
    for name in ("mlp.pt", "gpt.pt"):  # the same tensors (zip metadata may differ by version)
        a = torch.load(tmp_path / name, weights_only=True)
        b = torch.load(SAMPLES / name, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
