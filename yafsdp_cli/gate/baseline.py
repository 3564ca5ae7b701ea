"""The gate's baseline document: what was measured, and what rebuilds the same inputs.

A baseline (``yafsdp.baseline/2``) records

- ``source``: SOURCE and ``--model`` as given (a path under the directory ``check``
  ran in is stored relative to it, so a committed baseline works from any clone:
  ``check`` reads relative paths from the directory it runs in), and the source kind;
- ``inputs``: the memory model's options (``InspectInputs``): the fields of the
  options model's layout, step and memory pieces, which ``recorded_options`` rebuilds;
- ``memory``: the memory model's per-rank figures (``MemoryFigures``);
- ``step``: where the source has an architecture, a fake training step
  (``StepFigures``, its step piece's batch, micro-batches per optimizer step,
  length, checkpointing and optimizer in ``StepInputs``), else ``None`` with the
  reason in ``skipped``.

A ``yafsdp.inspect/1`` document (what ``check --update`` wrote before) is still a
baseline: its memory figures are checked and the step is reported as skipped. A
saved ``yafsdp plan --json`` document (``yafsdp.plan/1``) is a baseline of another
kind (``plan_baseline``): plan runs again and a configuration that fitted must fit.
Nothing here imports torch.

A baseline file is at most ``MAX_BASELINE_BYTES`` (refused before it is parsed), and
every number in it is a finite whole number in range (``yafsdp_cli.numbers``), refused
naming the file and the field: a ``NaN`` or ``1e400`` never reaches a comparison.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.choices import parse_loss
from ..errors import YafsdpError
from ..fileio import read_json
from ..inspection.build import InspectInputs
from ..inspection.inspect_options import InspectOptions
from ..numbers import MAX_BYTES, MAX_COUNT, MAX_GRAD_ACCUM, MAX_SEQ_LEN, checked
from ..options import StepOptions
from ..schemes import FLAT

SCHEMA = "yafsdp.baseline/2"
PLAN_SCHEMA = "yafsdp.plan/1"
LEGACY_SCHEMA = "yafsdp.inspect/1"
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "buffers")
PHASES = ("forward", "backward", "optimizer")
# a baseline is KBs; a saved plan with every scheme and a wide grid, a few hundred KB
MAX_BASELINE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class SourceRef:
    """What ``check`` loads: ``load_source(path, model=model)``."""

    path: str | None  # SOURCE, relative to where check runs when it lies below it
    model: str | None  # --model package.module:factory or path/to/file.py:factory
    kind: str  # "safetensors", "hf", "factory", ... (for the reader; not used to load)


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """The memory model's figures, per rank (the fullest rank)."""

    flat_bytes: int  # the flat scheme's total
    flat_persistent_bytes: int  # ... of which persists between steps
    ddp_bytes: int  # the DDP baseline
    largest_unit_bytes: int  # what is gathered at once
    parameters: int  # elements


# The options a baseline records (``InspectInputs``' fields but the source's), by the
# name of the piece field each is: only the unit globs are named otherwise.
INPUT_KEYS = {
    f.name: "units" if f.name == "unit_globs" else f.name
    for f in dataclasses.fields(InspectInputs)
    if f.name not in ("source", "model")
}


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The fake step's options (the converted model, rank 0 of ``world_size``)."""

    batch: int
    seq_len: int
    checkpointing: str  # a --checkpointing mode (engine.choices)
    world_size: int
    optimizer: str
    # as --loss names it; a baseline written before the step took other losses than
    # the projection records none, and was measured with the projection
    loss: str | None = None
    # micro-batches per optimizer step; 1 in baselines written before it was recorded
    grad_accum: int = 1

    def step_options(self) -> StepOptions:
        """The step piece these record (validated)."""
        return StepOptions(
            optimizer=self.optimizer,
            batch=self.batch,
            grad_accum=self.grad_accum,
            seq_len=self.seq_len,
            checkpointing=self.checkpointing,
            loss=self.loss,
        )


@dataclass(frozen=True, slots=True)
class ModuleSaved:
    """Bytes that modules of one name pattern (``model.layers.*.self_attn``: every
    layer's, ``count`` of them) made in forward and were still alive when backward
    began: what they save for backward. A module's figure includes its children's."""

    pattern: str
    count: int
    saved: int


@dataclass(frozen=True, slots=True)
class StepFigures:
    inputs: StepInputs
    batch: str  # the inputs made, e.g. "input_ids (2, 16) int64"
    peak: dict[str, int]  # bytes alive at the step's peak, by category
    peak_total: int
    peak_phase: str
    phase_peaks: dict[str, int]  # the highest total in each phase
    modules: tuple[ModuleSaved, ...]  # every pattern, most saved first
    # CUDA's caching allocator's predicted reserved peak for the step's trace (the
    # default settings, or PYTORCH_CUDA_ALLOC_CONF); None in baselines written before
    # it was recorded, which then skip it
    reserved_peak: int | None = None


@dataclass(frozen=True, slots=True)
class Baseline:
    source: SourceRef
    inputs: dict[str, Any]  # InspectInputs as a dict
    memory: MemoryFigures
    step: StepFigures | None
    skipped: tuple[str, ...] = ()  # why figures are missing
    schema: str = SCHEMA  # what the file said; LEGACY_SCHEMA for an inspect document


def recorded_options(
    inputs: Mapping[str, Any],
    *,
    layout: Mapping[str, Any] | None = None,
    step: Mapping[str, Any] | None = None,
    memory: Mapping[str, Any] | None = None,
) -> InspectOptions:
    """The memory model's options a baseline recorded (``Baseline.inputs``), rebuilt as
    the options model's pieces (each recorded name to the piece whose field it is), with
    the fields of each piece the user gave (``layout``, ``step``, ``memory``) in their
    place; the pieces validate both."""
    recorded = {kw: inputs[key] for key, kw in INPUT_KEYS.items() if key in inputs}
    base = InspectOptions()
    pieces = {}
    for name, given in (("layout", layout), ("step", step), ("memory", memory)):
        piece = getattr(base, name)
        names = {f.name for f in dataclasses.fields(piece)}
        own = {k: v for k, v in recorded.items() if k in names}
        pieces[name] = dataclasses.replace(piece, **{**own, **(given or {})})
    return InspectOptions(**pieces)


def recorded_inputs(options: InspectOptions) -> dict[str, Any]:
    """What a baseline records of ``options``, by the pieces' field names, in the
    pieces' order (what ``check``'s report shows it ran with)."""
    names = set(INPUT_KEYS.values())
    return {
        f.name: getattr(piece, f.name)
        for piece in (options.layout, options.step, options.memory)
        for f in dataclasses.fields(piece)
        if f.name in names
    }


def portable(path: str | None) -> str | None:
    """``path`` relative to the current directory when it lies below it."""
    if path is None or not os.path.isabs(path):
        return path
    try:
        rel = Path(path).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path
    return str(rel)


def portable_model(model: str | None) -> str | None:
    """A ``file.py:factory`` spec with its file made ``portable``; modules as given."""
    if model is None:
        return None
    target, sep, attr = model.rpartition(":")
    if sep and (target.endswith(".py") or os.sep in target):
        return f"{portable(target)}:{attr}"
    return model


# -------------------------------------------------------------------- writing


def to_json(baseline: Baseline) -> str:
    body = dataclasses.asdict(baseline)
    body.pop("schema")
    return json.dumps({"schema": SCHEMA, **body}, indent=2, allow_nan=False) + "\n"


def write_baseline(path: Path, baseline: Baseline) -> None:
    """Write to a temporary file beside ``path``, then rename it into place."""
    text = to_json(baseline)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -------------------------------------------------------------------- reading


def plan_baseline(path: Path) -> dict[str, Any] | None:
    """The ``yafsdp.plan/1`` document at ``path``, checked; ``None`` if the file is
    missing or holds anything else (``load_baseline`` then says what is wrong)."""
    try:
        doc = read_json(path, error=YafsdpError, cap=MAX_BASELINE_BYTES)
    except YafsdpError:
        return None
    if not isinstance(doc, dict) or doc.get("schema") != PLAN_SCHEMA:
        return None
    if not isinstance(doc.get("options"), dict) or not isinstance(doc.get("rows"), list):
        raise YafsdpError(f"baseline {path} lacks its plan options or rows; run plan again")
    return doc


def _loss(value, where: str) -> str | None:
    """A recorded ``--loss``; null: the model's default."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise YafsdpError(f"{where}: step.inputs.loss must be a string like chunked-ce:8")
    parse_loss(value)
    return value


def load_baseline(path: Path) -> Baseline:
    """Read and check a baseline; ``YafsdpError`` says what is wrong and what to do."""
    if not path.is_file():
        hint = f"yafsdp check SOURCE --baseline {path} --update"
        raise YafsdpError(f"no baseline at {path}; create one with: {hint}")
    try:
        doc = read_json(path, error=YafsdpError, cap=MAX_BASELINE_BYTES)
    except YafsdpError as exc:
        raise YafsdpError(f"baseline {exc}") from None
    schema = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
    if schema not in (SCHEMA, LEGACY_SCHEMA):
        raise YafsdpError(
            f"baseline {path} has schema {schema!r}, expected {SCHEMA!r} (or the older "
            f"{LEGACY_SCHEMA!r}); write one with --update"
        )
    where = f"baseline {path}:"
    try:
        baseline = _parse(doc, where) if schema == SCHEMA else _parse_legacy(doc, where)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise YafsdpError(f"baseline {path} lacks {exc}; regenerate it with --update") from None
    try:  # the recorded options, checked as the command line's are
        recorded_options(baseline.inputs)
    except YafsdpError as exc:
        raise YafsdpError(f"{where} recorded options: {exc}") from None
    return baseline


def _whole(value, where: str, field: str, high: int = MAX_BYTES) -> int:
    """A figure of the file: a whole number from 0 to ``high``, else an error naming
    the file and the field."""
    return checked(
        value, f"{where}{field}" if where.endswith(".") else f"{where} {field}", 0, high, whole=True
    )


def _parse(doc: dict, where: str) -> Baseline:
    step = doc["step"]
    return Baseline(
        source=SourceRef(**doc["source"]),
        inputs=dict(doc["inputs"]),
        memory=_ints(MemoryFigures, doc["memory"], where, "memory"),
        step=_parse_step(step, where) if step is not None else None,
        skipped=tuple(str(s) for s in doc.get("skipped", ())),
    )


def _parse_step(doc: dict, where: str = "baseline:") -> StepFigures:
    peak = {c: _whole(doc["peak"][c], where, f"step.peak.{c}") for c in CATEGORIES}
    phases = {
        p: _whole(v, where, f"step.phase_peaks.{p}")
        for p, v in dict(doc["phase_peaks"]).items()
        if p in PHASES
    }
    inputs = doc["inputs"]
    reserved = doc.get("reserved_peak")
    return StepFigures(
        inputs=StepInputs(
            batch=_whole(inputs["batch"], where, "step.inputs.batch", MAX_COUNT),
            seq_len=_whole(inputs["seq_len"], where, "step.inputs.seq_len", MAX_SEQ_LEN),
            checkpointing=str(inputs["checkpointing"]),
            world_size=_whole(inputs["world_size"], where, "step.inputs.world_size", MAX_COUNT),
            optimizer=str(inputs["optimizer"]),
            loss=_loss(inputs.get("loss", "projection"), where),
            grad_accum=checked(
                inputs.get("grad_accum", 1),
                f"{where} step.inputs.grad_accum",
                1,
                MAX_GRAD_ACCUM,
                whole=True,
            ),
        ),
        batch=str(doc["batch"]),
        peak=peak,
        peak_total=_whole(doc["peak_total"], where, "step.peak_total"),
        peak_phase=str(doc["peak_phase"]),
        phase_peaks=phases,
        modules=tuple(
            ModuleSaved(
                str(m["pattern"]),
                _whole(m["count"], where, "step.modules.count"),
                _whole(m["saved"], where, "step.modules.saved"),
            )
            for m in doc["modules"]
        ),
        reserved_peak=None if reserved is None else _whole(reserved, where, "step.reserved_peak"),
    )


def _ints(cls, doc: dict, where: str, part: str):
    fields = dataclasses.fields(cls)
    return cls(**{f.name: _whole(doc[f.name], where, f"{part}.{f.name}") for f in fields})


def _parse_legacy(doc: dict, where: str) -> Baseline:
    """A ``yafsdp.inspect/1`` document: memory figures only."""
    inputs = dict(doc["inputs"])
    memory, params = doc["memory"], doc["params"]
    persistent = next(s["persistent"] for s in memory["schemes"] if s["scheme"] == FLAT.inspect_key)
    model = inputs.get("model")
    source = inputs.get("source") or None
    if model and source:  # it recorded the spec's description, not SOURCE
        source = None if source == model else source.removesuffix(f" with --model {model}")
    figures = {
        "flat_bytes": memory["flat_bytes"],
        "flat_persistent_bytes": persistent,
        "ddp_bytes": memory["baseline_bytes"],
        "largest_unit_bytes": memory["largest_unit_bytes"],
        "parameters": params["total_numel"],
    }
    return Baseline(
        source=SourceRef(source, model, str(doc.get("source_kind", ""))),
        inputs=inputs,
        memory=_ints(MemoryFigures, figures, where, "memory"),
        step=None,
        skipped=(f"this baseline is an older {LEGACY_SCHEMA} document with no step figures",),
        schema=LEGACY_SCHEMA,
    )
