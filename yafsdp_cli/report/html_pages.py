"""``--html FILE``: one self-contained page per command, from the library's results.

- ``inspect_page(report)``: headline figures, per-rank memory of every scheme as
  stacked bars, every flat buffer as a bar of its entries with its rank shards
  (folded like the terminal: one buffer per group of identical ones, the rest
  behind an expand control), the tables, notes and assumptions;
- ``profile_page(report)``: each step's peak by category, and memory over the step
  (forward, backward, optimizer) for the original and the converted model;
- ``check_page(result, current)``: the gate's verdict and figures, then the current
  inspect page's content (the CI artifact);
- ``plan_heatmap(plan)`` (in ``html_charts``): the section ``yafsdp plan``'s page
  will add, a heat map of its fits grid.

Like every report module this computes nothing: it lays out figures the results
hold (positions on a bar are offsets over lengths). The CLI writes the page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..inspection.build import InspectReport
from ..schemes import DDP, FLAT
from .formatting import human_bytes, human_count
from .html_base import StackRow, cards, esc, notes_html, page, section_html, stacked_bars
from .html_charts import plan_heatmap, timeline_svg
from .html_layout import layout_section
from .inspect_view import header, memory_section, notes, summary_section

if TYPE_CHECKING:  # the profiling room imports torch; inspect pages must not
    from ..gate.regressions import CheckReport
    from ..profiling import ProfileReport

MEMORY_CATEGORIES = (  # (SchemeMemory field, label)
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer", "optimizer states"),
    ("master", "master weights"),
    ("buffers", "module buffers"),
    ("gather", "all-gather buffers"),
    ("reduce", "gradient buffers"),
)


def inspect_page(report: InspectReport) -> str:
    inp = report.inputs
    title = f"yafsdp inspect · {inp.source or inp.model}"
    subtitle = (
        f"world size {inp.world_size} · align {inp.align} · optimizer {inp.optimizer} · "
        f"{human_count(report.params.total_numel)} parameters in {len(report.buffers)} "
        "flat buffers"
    )
    nav = (("summary", "summary"), ("memory", "memory"), ("layout", "flat buffers"))
    return page(title, subtitle, (*nav, ("notes", "notes")), inspect_body(report))


def inspect_body(report: InspectReport) -> str:
    """The inspect page's sections (shared with the check page)."""
    return (
        summary_html(report)
        + memory_html(report)
        + layout_section(report)
        + notes_html("Notes and assumptions", notes(report))
    )


def summary_html(report: InspectReport) -> str:
    p, m = report.params, report.memory
    flat = next(s for s in m.schemes if s.scheme is FLAT)
    share = 100.0 * p.converted_numel / p.total_numel if p.total_numel else 0.0
    items = (
        ("parameters", human_count(p.total_numel), f"{p.total_numel:,} in {p.total_count}"),
        ("converted", f"{share:.1f}%", f"{p.converted_count} tensors, {len(report.buffers)} bufs"),
        ("padding", human_bytes(p.padding_bytes), f"{p.padding_percent:.3f}% of the buffers"),
        ("DDP per rank", human_bytes(m.baseline_bytes), "the baseline"),
        ("yafsdp per rank", human_bytes(m.flat_bytes), f"{flat.savings_percent:.1f}% saved"),
        ("largest unit", human_bytes(m.largest_unit_bytes), m.largest_unit or "the root unit"),
    )
    table = section_html(summary_section(report), "summary")
    table = f"<details><summary>summary table</summary>{table}</details>"
    return f'<section id="summary"><h2>Summary</h2>{cards(items)}{table}</section>'


def memory_html(report: InspectReport) -> str:
    rows = [
        StackRow(
            s.scheme.inspect_key,
            header(s.scheme),
            tuple(getattr(s, f) for f, _ in MEMORY_CATEGORIES),
            "baseline" if s.scheme is DDP else f"{s.savings_percent:.1f}% saved",
        )
        for s in report.memory.schemes
    ]
    bars = stacked_bars("memory", [label for _, label in MEMORY_CATEGORIES], rows)
    table = section_html(memory_section(report), "memory")
    return (
        f'<section id="memory"><h2>Memory per rank at world size '
        f"{report.inputs.world_size}</h2>"
        '<p class="caption">Bytes the fullest rank holds under each scheme, one scale for '
        "all; * reference estimates.</p>"
        f"{bars}<details><summary>memory table</summary>{table}</details></section>"
    )


# ---------------------------------------------------------------- profile


def profile_page(report: ProfileReport) -> str:
    from ..profiling import CATEGORIES
    from .profile_view import (
        LABELS,
        module_section,
        outside_section,
        peak_section,
        peak_where,
        verdict,
    )
    from .profile_view import summary_section as profile_summary

    o, c = report.original, report.converted_step
    change = 100.0 * (c.peak.total - o.peak.total) / o.peak.total if o.peak.total else 0.0
    rows = [
        StackRow("original", "original", tuple(getattr(o.peak, k) for k in CATEGORIES)),
        StackRow(
            "converted",
            "converted",
            tuple(getattr(c.peak, k) for k in CATEGORIES),
            f"{change:+.1f}%",
        ),
    ]
    items = (
        ("original peak", human_bytes(o.peak.total), f"in {peak_where(report, o)}"),
        ("converted peak", human_bytes(c.peak.total), f"in {peak_where(report, c)}"),
        ("change", f"{change:+.1f}%", human_bytes(abs(report.saving_bytes))),
        ("ranks", str(report.world_size), "converted runs as rank 0"),
    )
    if o.reserved and c.reserved:
        items += (
            ("GPU must hold", human_bytes(c.reserved.gpu_bytes), "converted: reserved + outside"),
        )
    tables = section_html(peak_section(report))
    if report.outside is not None:
        tables += section_html(outside_section(report))
    if o.modules or c.modules:
        tables += section_html(module_section(report))
    body = (
        f'<section id="summary"><h2>Summary</h2>{cards(items)}'
        f'<p class="verdict {"pass" if change <= 0 else "fail"}">{esc(verdict(report))}</p>'
        f"{section_html(profile_summary(report))}</section>"
        '<section id="peak"><h2>Peak of the step by category</h2>'
        f"{stacked_bars('peak', [LABELS[k] for k in CATEGORIES], rows)}"
        f"<details><summary>tables</summary>{tables}</details></section>"
        '<section id="timeline"><h2>Memory over the step</h2>'
        f"{timeline_svg((o, c))}</section>" + notes_html("Notes", report.notes)
    )
    title = f"yafsdp profile · {report.source}"
    subtitle = f"{report.inputs} · {report.optimizer} ({report.optimizer_impl})"
    nav = (("summary", "summary"), ("peak", "peak"), ("timeline", "over the step"))
    return page(title, subtitle, (*nav, ("notes", "notes")), body)


# ---------------------------------------------------------------- check


def check_page(result: CheckReport | None, current: InspectReport) -> str:
    """The gate's verdict and figures, then the current model's inspect sections;
    ``result`` is None when ``--update`` wrote a new baseline."""
    gate = _check_html(result) if result is not None else ""
    title = f"yafsdp check · {current.inputs.source or current.inputs.model}"
    subtitle = "new baseline written" if result is None else f"against {result.baseline_path}"
    nav = (("check", "check"), ("memory", "memory"), ("layout", "flat buffers"))
    return page(title, subtitle, (*nav, ("notes", "notes")), gate + inspect_body(current))


def _check_html(result: CheckReport) -> str:
    from .gate_view import verdict

    rows = []
    for m in result.metrics:
        fmt = human_bytes if m.unit == "bytes" else (lambda v: f"{v:,}")
        change = "new" if m.change_percent is None else f"{m.change_percent:+.2f}%"
        scale = max(m.baseline, m.current, 1)
        status = "REGRESSION" if m.regressed else "ok"
        rows.append(
            f'<tr data-metric="{esc(m.name)}" class="{"fail" if m.regressed else ""}">'
            f"<td>{esc(m.name)}</td>"
            f'<td class="r" data-value="{m.baseline}">{esc(fmt(m.baseline))}</td>'
            f'<td class="r" data-value="{m.current}">{esc(fmt(m.current))}</td>'
            f'<td class="r">{esc(change)}</td><td>{_pair(m.baseline, m.current, scale)}</td>'
            f"<td>{status}</td></tr>"
        )
    head = "<tr><th>figure</th><th>baseline</th><th>current</th><th>change</th>"
    head += "<th>grey: baseline, blue: current</th><th></th>"
    cls = "pass" if result.passed else "fail"
    return (
        f'<section id="check"><h2>Memory-regression gate</h2>'
        f'<p class="verdict {cls}">{esc(verdict(result))}</p>'
        + "".join(f"<p>skipped: {esc(s)}</p>" for s in result.skipped)
        + f"<table><thead>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _pair(baseline: int, current: int, scale: int) -> str:
    """Baseline (grey) over current (blue, red when it grew) on one scale."""
    colour = "#e45756" if current > baseline else "#4c78a8"
    b, c = 200 * baseline / scale, 200 * current / scale
    return (
        '<svg width="200" height="16" viewBox="0 0 200 16">'
        f'<rect width="{b:.1f}" height="7" fill="#aab4c0"/>'
        f'<rect y="8" width="{c:.1f}" height="7" fill="{colour}"/></svg>'
    )


__all__ = ["check_page", "inspect_body", "inspect_page", "plan_heatmap", "profile_page"]
