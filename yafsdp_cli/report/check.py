"""Rendering the memory-regression gate's result."""

from __future__ import annotations

from rich.text import Text

from ..gate.check import SCHEMA, CheckReport, MetricCheck
from .common import human_bytes, json_document, markdown_table, rich_table

HEADERS = ("figure", "baseline", "current", "change", "")


def _value(m: MetricCheck, v: int) -> str:
    return human_bytes(v) if m.unit == "bytes" else f"{v:,}"


def _change(m: MetricCheck) -> str:
    if m.change_percent is None:
        return "new"
    return f"{m.change_percent:+.2f}%"


def _rows(report: CheckReport) -> list[tuple[str, ...]]:
    return [
        (
            m.name,
            _value(m, m.baseline),
            _value(m, m.current),
            _change(m),
            "REGRESSION" if m.regressed else "ok",
        )
        for m in report.metrics
    ]


def verdict(report: CheckReport) -> str:
    if report.passed:
        return f"ok: no figure grew by more than {report.tolerance_percent:g}%"
    worst = ", ".join(f"{m.name} {_change(m)}" for m in report.regressions)
    return f"memory regression (tolerance {report.tolerance_percent:g}%): {worst}"


def to_rich(report: CheckReport) -> list:
    title = f"yafsdp check against {report.baseline_path}"
    table = rich_table(title, HEADERS, _rows(report), right=(1, 2, 3))
    style = "green" if report.passed else "bold red"
    return [table, Text(verdict(report), style=style)]


def to_markdown(report: CheckReport) -> str:
    return f"{markdown_table(HEADERS, _rows(report))}\n\n{verdict(report)}\n"


def to_json(report: CheckReport) -> str:
    return json_document(
        SCHEMA,
        {
            "baseline": report.baseline_path,
            "source": report.source,
            "passed": report.passed,
            "tolerance_percent": report.tolerance_percent,
            "metrics": report.metrics,
            "inputs": report.inputs,
        },
    )
