"""The regressions ``yafsdp check`` looks for: current figures against a baseline's.

Figures compared, all "more is worse":

- the memory model, per rank: the flat scheme's total and persistent bytes, the DDP
  baseline, the largest unit (what is gathered at once) and the parameter count.
  Padding is not a figure of its own: it shows in the totals, and a few hundred
  bytes of it must not fail a build. Default tolerance ``MEMORY_TOLERANCE``;
- the fake training step (``gate.step_figures``): its peak, the reserved peak CUDA's
  caching allocator would take for it (``memory.caching_allocator``; not compared
  against a baseline that lacks it), each phase's peak, the bytes
  of each category at the peak, and the activations the modules saved for backward
  (alive when backward began: what an attention switch or dropped checkpointing
  changes even where the peak moves to another moment and its activations shrink).
  Fake figures are exact and deterministic, so their default tolerance,
  ``STEP_TOLERANCE``, is tight.

A figure regresses when it grew past its tolerance in percent and past the byte floor
as well (``MIN_BYTES``, ``--min-bytes``): a few bytes of a buffer or of padding are a
large share of a small figure and nothing on a GPU, and a build must not fail on them.
The parameter count's floor is as many parameters (each takes a byte or more in every
dtype but 4-bit). A figure that was 0 and is not is one at any tolerance, once its
growth passes the floor. Activations that grew are explained by the
modules whose saved-for-backward bytes grew (``explain``). Per-module figures are
shown, not gated on their own: moving work from one module to another changes
them without changing what the step needs.

A plan baseline (a saved ``yafsdp plan --json``) is compared by ``plan_regressions``:
a configuration that fitted and no longer fits is a regression.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import YafsdpError
from .baseline import MemoryFigures, ModuleSaved, StepFigures, StepInputs

SCHEMA = "yafsdp.check/2"
MEMORY_TOLERANCE = 1.0  # percent
STEP_TOLERANCE = 0.1  # percent
# bytes: far below what changes whether a real model fits (its figures are GiB), far
# above a buffer's or padding's few bytes and the caching allocator's 512-byte rounding
MIN_BYTES = 1024**2
TOP_MODULES = 8  # module rows in a report
SHARE = 0.75  # a module "accounts for" growth when it holds this share of its parent's

# (MemoryFigures field, figure name, unit)
MEMORY_METRICS = (
    ("flat_bytes", "flat total per rank", "bytes"),
    ("flat_persistent_bytes", "flat persistent per rank", "bytes"),
    ("ddp_bytes", "DDP baseline per rank", "bytes"),
    ("largest_unit_bytes", "largest unit (gathered)", "bytes"),
    ("parameters", "parameters", "elements"),
)
STEP_CATEGORY_NAMES = {
    "parameters": "parameters at peak",
    "gradients": "gradients at peak",
    "optimizer": "optimizer state at peak",
    "activations": "activations at peak",
    "temporaries": "temporaries at peak",
    "buffers": "buffers at peak",
}
SAVED_NAME = "activations saved for backward"
RESERVED_NAME = "reserved peak (CUDA caching allocator)"
PHASE_NAMES = {
    "forward": "forward peak",
    "backward": "backward peak",
    "optimizer": "optimizer peak",
}


@dataclass(frozen=True, slots=True)
class MetricCheck:
    name: str
    unit: str  # "bytes" or "elements"
    baseline: int
    current: int
    change_percent: float | None  # (current - baseline) / baseline in percent; None from 0
    regressed: bool
    group: str = "memory"  # "memory" (the memory model) or "step" (the fake step)
    explained_by: tuple[str, ...] = ()  # modules that account for the growth


@dataclass(frozen=True, slots=True)
class ModuleChange:
    """One module pattern's saved-for-backward bytes, baseline against current."""

    pattern: str
    count: int
    baseline: int
    current: int


@dataclass(frozen=True, slots=True)
class CheckReport:
    baseline_path: str
    source: str
    tolerance_percent: float  # the memory model's figures
    step_tolerance_percent: float  # the fake step's
    metrics: tuple[MetricCheck, ...]
    inputs: dict[str, Any]  # the memory model's options used
    step_inputs: StepInputs | None = None  # None: the step was not compared
    step_batch: str = ""
    modules: tuple[ModuleChange, ...] = ()  # the top modules by saved bytes
    skipped: tuple[str, ...] = ()  # what was not checked, and why
    min_bytes: int = MIN_BYTES  # the byte floor of every figure

    @property
    def passed(self) -> bool:
        return not any(m.regressed for m in self.metrics)

    @property
    def regressions(self) -> tuple[MetricCheck, ...]:
        """The regressed figures, the largest growth in bytes first (what a reader
        acts on first), then the parameter count."""
        grown = [m for m in self.metrics if m.regressed]
        return tuple(sorted(grown, key=_growth_order))


def _growth_order(m: MetricCheck) -> tuple[int, int]:
    return (0, m.baseline - m.current) if m.unit == "bytes" else (1, 0)


def check_tolerance(percent: float) -> float:
    if percent < 0:
        raise YafsdpError(f"--tolerance must not be negative, got {percent}")
    return percent


def check_min_bytes(size: int) -> int:
    if size < 0:
        raise YafsdpError(f"--min-bytes must not be negative, got {size}")
    return size


@dataclass(frozen=True, slots=True)
class Threshold:
    """How much a figure may grow: ``percent`` of it and, in bytes, ``min_bytes``."""

    percent: float
    min_bytes: int = MIN_BYTES


def metric(name: str, unit: str, old: int, new: int, limit: Threshold, group: str):
    """One figure compared: growth past ``limit.percent`` and, for bytes, past
    ``limit.min_bytes`` is a regression."""
    past_floor = new - old > limit.min_bytes  # for the parameter count, in parameters
    if old:
        change = 100.0 * (new - old) / old
        grew = change > limit.percent and past_floor
        return MetricCheck(name, unit, old, new, change, grew, group)
    return MetricCheck(name, unit, old, new, 0.0 if new == 0 else None, past_floor, group)


def _threshold(tolerance: float | Threshold) -> Threshold:
    """A bare percent compares by percent alone (no byte floor)."""
    limit = tolerance if isinstance(tolerance, Threshold) else Threshold(tolerance, 0)
    check_tolerance(limit.percent)
    check_min_bytes(limit.min_bytes)
    return limit


def compare_memory(
    old: MemoryFigures, new: MemoryFigures, tolerance: float | Threshold
) -> list[MetricCheck]:
    """The memory model's figures; ``tolerance`` a percent (no byte floor) or a
    ``Threshold``."""
    limit = _threshold(tolerance)
    return [
        metric(name, unit, getattr(old, key), getattr(new, key), limit, "memory")
        for key, name, unit in MEMORY_METRICS
    ]


def compare_step(
    old: StepFigures, new: StepFigures, tolerance: float | Threshold
) -> list[MetricCheck]:
    """The step's peak, phase peaks and categories at the peak; grown activations name
    the modules that account for them."""
    limit = _threshold(tolerance)
    out = [metric("step peak", "bytes", old.peak_total, new.peak_total, limit, "step")]
    why = explain(old.modules, new.modules)
    for category, name in STEP_CATEGORY_NAMES.items():
        out.append(metric(name, "bytes", old.peak[category], new.peak[category], limit, "step"))
        if category == "activations":
            a, b = saved_total(old.modules), saved_total(new.modules)
            out.append(metric(SAVED_NAME, "bytes", a, b, limit, "step"))
            out[-2:] = [_with_explanation(m, why) if m.regressed else m for m in out[-2:]]
    for phase, name in PHASE_NAMES.items():
        if phase in old.phase_peaks or phase in new.phase_peaks:
            a, b = old.phase_peaks.get(phase, 0), new.phase_peaks.get(phase, 0)
            out.append(metric(name, "bytes", a, b, limit, "step"))
    if old.reserved_peak is not None and new.reserved_peak is not None:
        a, b = old.reserved_peak, new.reserved_peak
        out.append(metric(RESERVED_NAME, "bytes", a, b, limit, "step"))
    return out


def saved_total(modules: Sequence[ModuleSaved]) -> int:
    """What the model's modules saved for backward: the sum over the outermost ones."""
    return sum(m.saved for m in modules if "." not in m.pattern)


def _with_explanation(m: MetricCheck, modules: tuple[str, ...]) -> MetricCheck:
    return MetricCheck(
        m.name, m.unit, m.baseline, m.current, m.change_percent, m.regressed, m.group, modules
    )


def module_changes(old: Sequence[ModuleSaved], new: Sequence[ModuleSaved], top: int = TOP_MODULES):
    """The ``top`` module patterns by saved bytes (now or before), baseline vs current."""
    before = {m.pattern: m for m in old}
    after = {m.pattern: m for m in new}
    rows = []
    for p in dict.fromkeys([*after, *before]):
        a, b = before.get(p), after.get(p)
        count = (b or a).count
        rows.append(ModuleChange(p, count, a.saved if a else 0, b.saved if b else 0))
    rows.sort(key=lambda r: (-max(r.baseline, r.current), r.pattern))
    return tuple(rows[:top])


def explain(old: Sequence[ModuleSaved], new: Sequence[ModuleSaved]) -> tuple[str, ...]:
    """The modules that account for grown saved bytes, most specific first.

    From the top of the module tree, descend into the one child holding at least
    ``SHARE`` of its parent's growth; where growth is spread, name the node and the
    children holding a fifth of it or more (``model.layers.* (self_attn 48%, mlp
    32%)``). Empty when no module saves more than before.
    """
    delta = {m.pattern: -m.saved for m in old}
    for m in new:
        delta[m.pattern] = delta.get(m.pattern, 0) + m.saved
    node, grown = "", sum(d for p, d in delta.items() if "." not in p)
    if grown <= 0:
        return ()
    while True:
        kids = sorted(_children(delta, node), key=lambda p: -delta[p])
        if kids and delta[kids[0]] >= SHARE * grown:
            node, grown = kids[0], delta[kids[0]]
            continue
        big = [p for p in kids if delta[p] >= 0.2 * grown]
        if not node:
            return tuple(big)
        parts = ", ".join(f"{p[len(node) + 1 :]} {delta[p] / grown:.0%}" for p in big)
        return (f"{node} ({parts})" if parts else node,)


def _children(delta: Mapping[str, int], node: str) -> list[str]:
    """The nearest grown descendants of ``node`` ("" is the root): a ``ModuleList``
    never runs, so ``model.layers.*`` is a child of ``model``."""
    prefix = f"{node}." if node else ""
    below = [p for p in delta if p.startswith(prefix) and p != node]
    inner = set(below)
    return [p for p in below if delta[p] > 0 and not any(_ancestor(q, p) for q in inner if q != p)]


def _ancestor(a: str, b: str) -> bool:
    return b.startswith(f"{a}.")


def plan_regressions(baseline: Mapping[str, Any], current) -> tuple[str, ...]:
    """Each configuration that fitted in ``baseline`` (a ``yafsdp.plan/1`` document)
    and does not in ``current`` (a ``planning.PlanReport``), as a sentence naming it
    and both peaks."""
    now = {(r.world_size, r.micro_batch, r.seq_len, r.checkpointing): r for r in current.rows}
    out = []
    for row in baseline["rows"]:
        key = (row["world_size"], row["micro_batch"], row["seq_len"], row["checkpointing"])
        new = now.get(key)
        if row["fits"] and new is not None and not new.fits:
            ws, mb, seq, ck = key
            out.append(
                f"world size {ws}, micro-batch {mb} x {seq} tokens, checkpointing {ck}: "
                f"fitted ({row['needed_bytes']} B), now needs {new.needed_bytes} B "
                f"of {current.gpu_memory_bytes} B"
            )
    return tuple(out)
