"""``check``: the CI memory-regression gate.

A baseline is a saved ``yafsdp plan --json`` document (``plan_regressions``: a
configuration that fitted and no longer fits is a regression) or a saved
``yafsdp inspect --json`` document (``check --update`` writes
one). ``check`` re-inspects the model with the inputs the baseline records (any
option given on the command line overrides them) and compares a few per-rank
figures; a figure that grew by more than the tolerance is a regression (exit 1).

Figures compared, all "more is worse": the flat scheme's total and persistent bytes
per rank, the DDP baseline per rank, the largest unit (what is gathered at once) and
the parameter count. Padding is not a figure of its own: it shows in the totals, and
a few hundred bytes of it must not fail a build. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import YafsdpError

SCHEMA = "yafsdp.check/1"
BASELINE_SCHEMA = "yafsdp.inspect/1"
PLAN_SCHEMA = "yafsdp.plan/1"

# (name, unit, how to read it from an inspect document)
METRICS: tuple[tuple[str, str, Any], ...] = (
    ("flat total per rank", "bytes", lambda d: d["memory"]["flat_bytes"]),
    ("flat persistent per rank", "bytes", lambda d: _scheme(d, "yafsdp")["persistent"]),
    ("DDP baseline per rank", "bytes", lambda d: d["memory"]["baseline_bytes"]),
    ("largest unit (gathered)", "bytes", lambda d: d["memory"]["largest_unit_bytes"]),
    ("parameters", "elements", lambda d: d["params"]["total_numel"]),
)

# The inspect options a baseline records, by their inspect_model keyword.
INPUT_KEYS = {
    "filters": "filters",
    "excludes": "excludes",
    "unit_globs": "units",
    "world_size": "world_size",
    "align": "align",
    "param_dtype": "param_dtype",
    "grad_dtype": "grad_dtype",
    "optimizer": "optimizer",
    "master_weights": "master_weights",
    "round_bytes": "round_bytes",
    "fsdp_placement": "fsdp_placement",
}


@dataclass(frozen=True, slots=True)
class MetricCheck:
    name: str
    unit: str  # "bytes" or "elements"
    baseline: int
    current: int
    change_percent: float | None  # (current - baseline) / baseline in percent; None from 0
    regressed: bool


@dataclass(frozen=True, slots=True)
class CheckReport:
    baseline_path: str
    source: str
    tolerance_percent: float
    metrics: tuple[MetricCheck, ...]
    inputs: dict[str, Any]  # the inspect options used

    @property
    def passed(self) -> bool:
        return not any(m.regressed for m in self.metrics)

    @property
    def regressions(self) -> tuple[MetricCheck, ...]:
        return tuple(m for m in self.metrics if m.regressed)


def _scheme(doc: Mapping, name: str) -> Mapping:
    for s in doc["memory"]["schemes"]:
        if s["scheme"] == name:
            return s
    raise KeyError(name)


def load_baseline(path: Path) -> dict[str, Any]:
    """Read and check a baseline document; ``YafsdpError`` says what is wrong."""
    if not path.is_file():
        hint = f"yafsdp check SOURCE --baseline {path} --update"
        raise YafsdpError(f"no baseline at {path}; create one with: {hint}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise YafsdpError(f"baseline {path} is not valid JSON ({exc})") from None
    if isinstance(doc, dict) and doc.get("schema") == PLAN_SCHEMA:
        if not isinstance(doc.get("options"), dict) or not isinstance(doc.get("rows"), list):
            raise YafsdpError(f"baseline {path} lacks its plan options or rows; run plan again")
        return doc
    if not isinstance(doc, dict) or doc.get("schema") != BASELINE_SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise YafsdpError(
            f"baseline {path} has schema {found!r}, expected {BASELINE_SCHEMA!r} "
            "(a `yafsdp inspect --json` document)"
        )
    try:
        for _, _, read in METRICS:
            int(read(doc))
        dict(doc["inputs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise YafsdpError(f"baseline {path} lacks {exc}; regenerate it with --update") from None
    return doc


def baseline_inputs(doc: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``inspect_model`` keywords: the baseline's recorded inputs, then ``overrides``
    (options the user gave, ``None`` meaning "as recorded")."""
    recorded = doc.get("inputs", {})
    kwargs = {kw: recorded[key] for key, kw in INPUT_KEYS.items() if key in recorded}
    for key in ("filters", "excludes", "units"):
        kwargs[key] = tuple(kwargs.get(key) or ())
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return kwargs


def compare(
    baseline: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    tolerance_percent: float,
    baseline_path: str,
    inputs: Mapping[str, Any],
) -> CheckReport:
    """Compare two inspect documents figure by figure."""
    if tolerance_percent < 0:
        raise YafsdpError(f"--tolerance must not be negative, got {tolerance_percent}")
    metrics = []
    for name, unit, read in METRICS:
        old, new = int(read(baseline)), int(read(current))
        if old:
            change = 100.0 * (new - old) / old
            regressed = change > tolerance_percent
        else:
            change, regressed = (0.0 if new == 0 else None), new > 0
        metrics.append(MetricCheck(name, unit, old, new, change, regressed))
    return CheckReport(
        baseline_path=baseline_path,
        source=str(current.get("inputs", {}).get("source", "")),
        tolerance_percent=tolerance_percent,
        metrics=tuple(metrics),
        inputs=dict(inputs),
    )


def plan_regressions(baseline: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[str, ...]:
    """Each configuration that fitted in ``baseline`` and does not in ``current`` (two
    ``yafsdp.plan/1`` documents), as a sentence naming it and both peaks."""

    def key(row: Mapping[str, Any]) -> tuple:
        return (row["world_size"], row["micro_batch"], row["seq_len"], row["checkpointing"])

    now = {key(r): r for r in current["rows"]}
    out = []
    for row in baseline["rows"]:
        new = now.get(key(row))
        if row["fits"] and new is not None and not new["fits"]:
            ws, mb, seq, ck = key(row)
            out.append(
                f"world size {ws}, micro-batch {mb} x {seq} tokens, checkpointing {ck}: "
                f"fitted ({row['needed_bytes']} B), now needs {new['needed_bytes']} B "
                f"of {current['gpu_memory_bytes']} B"
            )
    return tuple(out)
