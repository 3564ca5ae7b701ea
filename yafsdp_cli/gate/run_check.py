"""``run_check``: rebuild the baseline's inputs, measure, then compare or record.

The CLI gives what the user typed (``CheckRequest``: the options it gave, by the
options model's names; an absent or ``None`` one is "as the baseline recorded it");
this loads the baseline, rebuilds the options' pieces from it with the given ones in
their place (``baseline.recorded_options``), loads the same source (SOURCE and
``--model`` as recorded, relative paths read from the directory check runs in),
runs the memory model and, where the source has an architecture, the fake step,
then writes a new baseline (``update``) or compares against the old one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import YafsdpError
from ..inspection.build import InspectReport, inspect_model
from ..options import StepOptions
from ..schemes import FLAT
from ..sources import load_source
from ..sources.adapted import adapt
from .baseline import (
    Baseline,
    MemoryFigures,
    SourceRef,
    StepFigures,
    StepInputs,
    load_baseline,
    portable,
    portable_model,
    recorded_inputs,
    recorded_options,
    write_baseline,
)
from .regressions import (
    MEMORY_TOLERANCE,
    MIN_BYTES,
    STEP_TOLERANCE,
    CheckReport,
    Threshold,
    compare_memory,
    compare_step,
    module_changes,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckRequest:
    baseline: Path
    source: str | None = None
    model: str | None = None
    update: bool = False
    tolerance: float | None = None  # None: MEMORY_TOLERANCE, and STEP_TOLERANCE for the step
    step_tolerance: float | None = None  # None: --tolerance if given, else STEP_TOLERANCE
    min_bytes: int | None = None  # None: MIN_BYTES, for the memory model's and the step's
    # the fields of each piece given (the rest: as the baseline recorded them); of the
    # step, the memory model's and the fake step's batch, grad_accum, seq_len and
    # checkpointing
    layout_given: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    step_given: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    memory_given: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    step: bool = True  # False: --no-step
    trust_pickle: bool = False

    @property
    def tolerances(self) -> tuple[float, float]:
        memory = MEMORY_TOLERANCE if self.tolerance is None else self.tolerance
        step = self.step_tolerance if self.step_tolerance is not None else self.tolerance
        return memory, STEP_TOLERANCE if step is None else step


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    current: Baseline  # what was measured now (the file's new content with --update)
    inspect: InspectReport
    report: CheckReport | None  # None with --update


def run_check(req: CheckRequest) -> CheckOutcome:
    given_step(req)
    old = _previous(req)
    options = recorded_options(
        old.inputs if old else {},
        layout=req.layout_given,
        step=req.step_given,
        memory=req.memory_given,
    )
    source = req.source or (old.source.path if old else None)
    model = req.model or (old.source.model if old else None)
    loaded = adapt(load_source(source, model=model, trust_pickle=req.trust_pickle), options.step)
    report = inspect_model(loaded, options, model=model)
    step, skipped = _step(req, old, loaded, report, options)
    current = Baseline(
        source=SourceRef(portable(source), portable_model(model), report.source_kind),
        inputs=dataclasses.asdict(report.inputs),
        memory=memory_figures(report),
        step=step,
        skipped=skipped,
    )
    if req.update:
        write_baseline(req.baseline, current)
        return CheckOutcome(current, report, None)
    return CheckOutcome(current, report, compare(req, old, current, recorded_inputs(options)))


def _previous(req: CheckRequest) -> Baseline | None:
    """The baseline to check against; with ``--update`` an unreadable one is replaced."""
    if not req.update:
        return load_baseline(req.baseline)
    try:
        return load_baseline(req.baseline)
    except YafsdpError:
        return None


def memory_figures(report: InspectReport) -> MemoryFigures:
    mem = report.memory
    flat = next(s for s in mem.schemes if s.scheme is FLAT)
    return MemoryFigures(
        flat_bytes=mem.flat_bytes,
        flat_persistent_bytes=flat.persistent,
        ddp_bytes=mem.baseline_bytes,
        largest_unit_bytes=mem.largest_unit_bytes,
        parameters=report.params.total_numel,
    )


# the step piece's fields check takes
STEP_NAMES = ("batch", "grad_accum", "seq_len", "checkpointing", "loss")


def given_step(req: CheckRequest) -> dict[str, Any]:
    """The step options the request gives, validated (as a step piece) before anything
    runs."""
    given = {k: req.step_given[k] for k in STEP_NAMES if req.step_given.get(k) is not None}
    StepOptions(**given)
    return given


def step_inputs(req: CheckRequest, old: Baseline | None, report: InspectReport) -> StepInputs:
    """The request's step options, else the baseline's, else profile's defaults; ranks
    and optimizer are the memory model's."""
    recorded = old.step.inputs.step_options() if old and old.step else StepOptions()
    step = dataclasses.replace(recorded, **given_step(req))
    return StepInputs(
        step.batch,
        step.seq_len,
        step.checkpointing,
        report.inputs.world_size,
        report.inputs.optimizer,
        loss=step.loss,
        grad_accum=step.grad_accum,
    )


def _step(req, old, loaded, report, inputs) -> tuple[StepFigures | None, tuple[str, ...]]:
    """The fake step's figures, or ``None`` and why not."""
    if not req.step:
        return None, ("fake step: not run (--no-step)",)
    if not report.has_architecture:
        if old is not None and old.step is not None and not req.update:
            raise YafsdpError(
                f"the baseline records a training step, but {report.inputs.source} has no "
                "architecture to run one; give --model package.module:factory, or --no-step "
                "to check the memory model only"
            )
        return None, (
            "fake step: not run (the source has no architecture; give --model "
            "package.module:factory to gate a training step too)",
        )
    if not req.update and (old is None or old.step is None):
        return None, ("fake step: not in the baseline; --update records one",)
    from .step_figures import measure_step

    return measure_step(loaded, step_inputs(req, old, report), inputs.layout), ()


def compare(req: CheckRequest, old: Baseline, current: Baseline, inputs) -> CheckReport:
    tol, step_tol = req.tolerances
    floor = MIN_BYTES if req.min_bytes is None else req.min_bytes
    metrics = compare_memory(old.memory, current.memory, Threshold(tol, floor))
    modules: tuple = ()
    if old.step is not None and current.step is not None:
        metrics += compare_step(old.step, current.step, Threshold(step_tol, floor))
        modules = module_changes(old.step.modules, current.step.modules)
        skipped: tuple[str, ...] = ()
    elif old.step is None:
        skipped = tuple(dict.fromkeys([*old.skipped, *current.skipped]))
    else:
        skipped = current.skipped
    compared = current.step if old.step is not None else None
    return CheckReport(
        baseline_path=str(req.baseline),
        source=current.source.path or current.source.model or "",
        tolerance_percent=tol,
        step_tolerance_percent=step_tol,
        min_bytes=floor,
        metrics=tuple(metrics),
        inputs=dict(inputs),
        step_inputs=compared.inputs if compared else None,
        step_batch=compared.batch if compared else "",
        modules=modules,
        skipped=skipped,
    )
