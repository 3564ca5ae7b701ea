"""The gate's training step: one fake step of the converted model, as figures.

The step is ``profile --fake``'s (``profiling.profile_model`` under FakeTensorMode):
shapes and dtypes only, so it costs no memory and its figures are exact and the same
on every machine and every run, which is what a gate needs (a real step's peak
depends on the allocator and the platform). Of the two steps profile takes, the
converted model's (rank 0 of ``--world-size``) is the one training runs and the one
gated; it runs in the weights' stored dtypes.

Per-module figures are what each module's forward saved for backward, summed over
modules whose names differ only in their indices (``model.layers.*.self_attn``).
"""

from __future__ import annotations

import dataclasses
import re
import warnings

from ..memory import reserved_of
from ..options import LayoutOptions
from ..options.alloc_conf import allocator_setting
from ..profiling import ProfileOptions, profile_model
from .baseline import CATEGORIES, ModuleSaved, StepFigures, StepInputs

_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted part made of digits
MODULE_DEPTH = 64  # follow every module (a name has fewer parts than this)


def pattern(name: str) -> str:
    """``model.layers.12.mlp`` -> ``model.layers.*.mlp``."""
    return _INDEX.sub("*", name)


def step_options(inputs: StepInputs, layout: LayoutOptions) -> ProfileOptions:
    """``ProfileOptions`` for the gate's step: the memory model's layout piece at the
    step's world size, the step's batch, length, checkpointing and optimizer, every
    module followed."""
    return ProfileOptions(
        layout=dataclasses.replace(layout, world_size=inputs.world_size),
        step=inputs.step_options(),
        fake=True,
        per_module=True,
        depth=MODULE_DEPTH,
    )


def measure_step(loaded, inputs: StepInputs, layout: LayoutOptions) -> StepFigures:
    """Run the fake step of ``loaded`` (``sources.load_source``) and keep its figures."""
    opts = step_options(inputs, layout)
    with warnings.catch_warnings():
        # transformers deprecates the checkpointing call it still honours; CI logs
        # should carry the verdict, not that.
        warnings.simplefilter("ignore", FutureWarning)
        traces: dict = {}
        report = profile_model(loaded, opts, traces=traces)
    step = report.converted_step
    conf = allocator_setting(None)  # the variable's, named in its errors
    return StepFigures(
        inputs=dataclasses.replace(inputs, loss=report.loss),  # the model's default named
        batch=report.inputs,
        peak={c: getattr(step.peak, c) for c in CATEGORIES},
        peak_total=step.peak.total,
        peak_phase=step.peak_phase,
        phase_peaks=dict(step.phase_peaks),
        modules=saved_by_pattern((m.name, m.saved) for m in step.modules),
        reserved_peak=reserved_of(traces["converted"], conf).reserved_peak,
    )


def saved_by_pattern(rows) -> tuple[ModuleSaved, ...]:
    """``(name, saved)`` rows summed by ``pattern``, most saved first."""
    groups: dict[str, list[int]] = {}
    for name, saved in rows:
        group = groups.setdefault(pattern(name), [0, 0])
        group[0] += 1
        group[1] += saved
    out = [ModuleSaved(p, count, saved) for p, (count, saved) in groups.items()]
    out.sort(key=lambda m: (-m.saved, m.pattern))
    return tuple(out)
