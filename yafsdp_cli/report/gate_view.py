"""Rendering the memory-regression gate's result: terminal, markdown, JSON."""

from __future__ import annotations

from rich.text import Text

from ..gate.regressions import SCHEMA, CheckReport, MetricCheck, ModuleChange
from .formatting import human_bytes, json_document, markdown_table, rich_table

HEADERS = ("figure", "baseline", "current", "change", "")
MODULE_HEADERS = ("module", "count", "baseline", "current", "change")


def _value(m: MetricCheck, v: int) -> str:
    return human_bytes(v) if m.unit == "bytes" else f"{v:,}"


def _percent(old: int, new: int) -> str:
    if old == 0:
        return "0.00%" if new == 0 else "new"
    return f"{100.0 * (new - old) / old:+.2f}%"


def _change(m: MetricCheck) -> str:
    return "new" if m.change_percent is None else f"{m.change_percent:+.2f}%"


def _delta(m: MetricCheck) -> str:
    d = m.current - m.baseline
    sign = "+" if d >= 0 else "-"
    return f"{sign}{human_bytes(abs(d))}" if m.unit == "bytes" else f"{d:+,}"


def _rows(report: CheckReport, group: str) -> list[tuple[str, ...]]:
    return [
        (
            m.name,
            _value(m, m.baseline),
            _value(m, m.current),
            _change(m),
            "REGRESSION" if m.regressed else "ok",
        )
        for m in report.metrics
        if m.group == group
    ]


def _module_rows(modules: tuple[ModuleChange, ...]) -> list[tuple[str, ...]]:
    return [
        (
            r.pattern,
            str(r.count),
            human_bytes(r.baseline),
            human_bytes(r.current),
            _percent(r.baseline, r.current),
        )
        for r in modules
    ]


def _tolerances(report: CheckReport) -> str:
    text = f"memory model {report.tolerance_percent:g}%"
    if report.step_inputs is not None:
        text += f", fake step {report.step_tolerance_percent:g}%"
    return f"{text}; byte floor {human_bytes(report.min_bytes)}"


def regression_line(m: MetricCheck) -> str:
    """``activations at peak +95.9 MiB (+132.00%): model.layers.*.self_attn``."""
    line = f"{m.name} {_delta(m)} ({_change(m)})"
    return f"{line}: {', '.join(m.explained_by)}" if m.explained_by else line


def _counted(report: CheckReport) -> str:
    """``no figure grew past its tolerance`` or ``3 figures grew past tolerance``."""
    if report.passed:
        return "no figure grew past its tolerance"
    n = len(report.regressions)
    return f"{n} {'figure' if n == 1 else 'figures'} grew past tolerance"


def headline(report: CheckReport) -> str:
    """The verdict in one line, without the regressions it counts."""
    verdict = "ok" if report.passed else "memory regression"
    return f"{verdict}: {_counted(report)} ({_tolerances(report)})"


def verdict(report: CheckReport) -> str:
    """The headline and each regression, the largest first, in one line."""
    if report.passed:
        return headline(report)
    return f"{headline(report)}: " + "; ".join(regression_line(m) for m in report.regressions)


def _titles(report: CheckReport) -> tuple[str, str]:
    ranks = report.inputs.get("world_size", 1)
    memory = f"memory model, per rank at world size {ranks}"
    s = report.step_inputs
    if s is None:
        return memory, ""
    accum = f", {s.grad_accum} micro-batches per optimizer step" if s.grad_accum > 1 else ""
    step = (
        f"fake training step: converted model, rank 0 of {s.world_size}, {report.step_batch}"
        f"{accum}, checkpointing {s.checkpointing}, optimizer {s.optimizer}"
    )
    return memory, step


def to_rich(report: CheckReport) -> list:
    """The verdict first (a CI log is read from where the gate's output begins), each
    regression under it, the largest first; then the figures."""
    memory, step = _titles(report)
    if report.passed:
        out: list = [Text(headline(report), style="green")]
    else:
        out = [Text(headline(report), style="bold red")]
        out += [Text(f"  {regression_line(m)}", style="red") for m in report.regressions]
    out.append(rich_table(memory, HEADERS, _rows(report, "memory"), right=(1, 2, 3)))
    if step:
        out.append(rich_table(step, HEADERS, _rows(report, "step"), right=(1, 2, 3)))
    if report.modules:
        title = "saved for backward, by module (the largest)"
        rows = _module_rows(report.modules)
        out.append(rich_table(title, MODULE_HEADERS, rows, (1, 2, 3, 4), names=(0,)))
    out += [Text(f"skipped: {s}", style="yellow") for s in report.skipped]
    return out


def to_markdown(report: CheckReport) -> str:
    """For a pull request comment or a job summary (``>> $GITHUB_STEP_SUMMARY``)."""
    status = "passed" if report.passed else "FAILED"
    lines = [
        f"## yafsdp check: {status}: {_counted(report)}",  # the verdict and its count first
        "",
        f"`{report.source}` against `{report.baseline_path}`; tolerance: {_tolerances(report)}.",
    ]
    if report.regressions or report.skipped:
        lines += [""]
    lines += [f"- **{regression_line(m)}**" for m in report.regressions]
    lines += [f"- skipped: {s}" for s in report.skipped]
    memory, step = _titles(report)
    lines += ["", f"### {memory}", "", markdown_table(HEADERS, _rows(report, "memory"))]
    if step:
        lines += ["", f"### {step}", "", markdown_table(HEADERS, _rows(report, "step"))]
    if report.modules:
        rows = _module_rows(report.modules)
        lines += ["", "### saved for backward, by module", "", markdown_table(MODULE_HEADERS, rows)]
    return "\n".join(lines) + "\n"


def to_json(report: CheckReport) -> str:
    return json_document(
        SCHEMA,
        {
            "baseline": report.baseline_path,
            "source": report.source,
            "passed": report.passed,
            "tolerance_percent": report.tolerance_percent,
            "step_tolerance_percent": report.step_tolerance_percent,
            "min_bytes": report.min_bytes,
            "metrics": report.metrics,
            "modules": report.modules,
            "skipped": report.skipped,
            "inputs": report.inputs,
            "step_inputs": report.step_inputs,
            "step_batch": report.step_batch,
        },
    )
