"""The gate's reserved figure: recorded, compared with the step's tolerance, and
skipped against a baseline written without it."""

from __future__ import annotations

import dataclasses
import json

from helpers import options

from yafsdp_cli.gate.baseline import StepFigures, StepInputs, _parse_step
from yafsdp_cli.gate.regressions import RESERVED_NAME, compare_step
from yafsdp_cli.gate.step_figures import measure_step
from yafsdp_cli.memory import reserved_of
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

CATS = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
INPUTS = StepInputs(batch=2, seq_len=16, checkpointing="none", world_size=1, optimizer="adamw")


def figures(reserved: int | None) -> StepFigures:
    return StepFigures(
        inputs=INPUTS,
        batch="input (2, 16) int64",
        peak=dict.fromkeys(CATS, 10),
        peak_total=60,
        peak_phase="backward",
        phase_peaks={"forward": 50, "backward": 60},
        modules=(),
        reserved_peak=reserved,
    )


def names(checks) -> dict:
    return {m.name: m for m in checks}


def test_reserved_is_compared_with_the_step_tolerance():
    grown = names(compare_step(figures(20 << 20), figures(22 << 20), 0.1))
    assert grown[RESERVED_NAME].regressed
    same = names(compare_step(figures(20 << 20), figures(20 << 20), 0.1))
    assert not same[RESERVED_NAME].regressed


def test_a_baseline_without_reserved_is_read_and_skips_it():
    doc = json.loads(json.dumps(dataclasses.asdict(figures(None))))
    doc.pop("reserved_peak")
    old = _parse_step(doc)
    assert old.reserved_peak is None
    assert RESERVED_NAME not in names(compare_step(old, figures(20 << 20), 0.1))
    assert _parse_step(dataclasses.asdict(figures(5))).reserved_peak == 5


def test_measured_reserved_is_the_replay_of_the_converted_step(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    loaded = load_source(None, model="sample_models.models:gpt")
    got = measure_step(loaded, INPUTS, LayoutOptions())
    traces: dict = {}
    opts = options(ProfileOptions, fake=True, per_module=True, depth=64)
    profile_model(load_source(None, model="sample_models.models:gpt"), opts, traces=traces)
    assert got.reserved_peak == reserved_of(traces["converted"]).reserved_peak > 0
