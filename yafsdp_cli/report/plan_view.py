"""``yafsdp plan`` output: the fits grid as a Rich table, markdown, JSON and HTML."""

from __future__ import annotations

from ..planning import SCHEMA, PlanReport, PlanRow
from . import scheme_view
from .formatting import human_bytes, json_document, markdown_table, plain
from .plan_time_view import best_line, time_section

MARK = {True: "fits", False: "OOM"}
ADVISED = "fits*"  # fits only under another allocator setting (the legend names it)


def to_json(report: PlanReport) -> str:
    """One ``yafsdp.plan/1`` document: every field of the report, in bytes."""
    payload = plain(report)
    # the options as the command line names them: what ``check`` rebuilds them from
    payload["options"] = plain(report.options.flat()) if report.options else None
    payload["rows"] = [_row_json(r) for r in report.rows]
    payload["best"] = _row_json(report.best) if report.best else None
    payload["linearity"] = [{**plain(c), "error": c.error} for c in report.linearity]
    payload["schemes"] = scheme_view.payload(report)
    payload["reserved_checks"] = [{**plain(c), "error": c.error} for c in report.reserved_checks]
    return json_document(SCHEMA, payload)


def _row_json(row: PlanRow) -> dict:
    doc = plain(row)
    if row.time is not None:
        doc["time"]["exposed_share"] = row.time.exposed_share
    return doc


def heatmap_data(report: PlanReport) -> dict:
    """What ``html_charts.plan_heatmap`` takes: cells coloured by what the GPU must
    hold (reserved peak + the memory beside the allocator), each with its figures."""
    return {
        "gpu_memory_bytes": report.gpu_memory_bytes,
        "cells": [
            {
                "world_size": r.world_size,
                "micro_batch": r.micro_batch,
                "checkpointing": r.checkpointing,
                "peak_bytes": r.needed_bytes,
                "tip": _figures(r),
            }
            for r in report.rows
        ],
    }


def _figures(r: PlanRow) -> str:
    """A cell's figures in one line: allocated, reserved, each part beside, needed."""
    beside = " + ".join(f"{p.name} {human_bytes(p.bytes)}" for p in r.outside if p.bytes)
    text = (
        f"allocated {human_bytes(r.peak_bytes)} + fragmentation "
        f"{human_bytes(r.fragmentation_bytes)} = reserved {human_bytes(r.reserved_bytes)}"
        + (f"; + {beside}" if beside else "")
        + f" = needed {human_bytes(r.needed_bytes)}"
        + ("" if r.reserved_replayed else " (reserved carried from other runs)")
    )
    if r.fits_with is not None:
        text += (
            f"; with {r.fits_with.alloc_conf}: reserved "
            f"{human_bytes(r.fits_with.reserved_bytes)}, needed "
            f"{human_bytes(r.fits_with.needed_bytes)}"
        )
    return text


def grid(report: PlanReport, checkpointing: str) -> tuple[list[str], list[list[str]]]:
    """One checkpointing choice: rows = world sizes, columns = micro-batches."""
    at = {(r.world_size, r.micro_batch, r.checkpointing): r for r in report.rows}
    headers = ["world size", *(f"micro-batch {mb}" for mb in report.micro_batches)]
    body = [
        [str(ws), *(_cell(at.get((ws, mb, checkpointing))) for mb in report.micro_batches)]
        for ws in report.world_sizes
    ]
    return headers, body


def _cell(row: PlanRow | None) -> str:
    """What the GPU must hold, and the verdict (``cells`` has every figure)."""
    if row is None:
        return "-"
    if row.fits_with is not None:  # what it needs under the setting it fits with
        return f"{human_bytes(row.fits_with.needed_bytes)} {ADVISED}"
    return f"{human_bytes(row.needed_bytes)} {MARK[row.fits]}"


def summary_lines(report: PlanReport) -> list[str]:
    tokens = f"{report.seq_len} tokens per sequence"
    lines = [
        f"{report.source}: needed per rank, what the GPU must hold (the caching allocator's "
        f"reserved peak + the memory beside it), against {human_bytes(report.gpu_memory_bytes)} "
        f"per GPU, {tokens}, {report.param_dtype} parameters, gradients in "
        f"{report.grad_dtype}, {report.optimizer} ({report.optimizer_impl}), allocator "
        f"settings: {report.alloc_conf or 'none (--target cpu)'}",
    ]
    advised = next((r.fits_with for r in report.rows if r.fits_with is not None), None)
    if advised is not None:
        lines.append(f"{ADVISED}: fits only with {advised.export} (needed under it)")
    for s in report.smallest:
        where = f"world size {s.world_size}" if s.world_size else "no world size in the grid"
        lines.append(
            f"smallest that fits, micro-batch {s.micro_batch}, checkpointing "
            f"{s.checkpointing}: {where}"
        )
    margin = human_bytes(report.margin_bytes)
    if report.best is None:
        lines.append(f"best: nothing in the grid fits keeping the margin of {margin} free")
    else:
        lines.append("best: " + _breakdown(report.best, report))
    if report.advice is not None:
        advice = report.advice
        lines.append(f"better with {advice.export}: " + _breakdown(advice.row, report))
    fastest = best_line(report)
    if fastest:
        lines.append(fastest)
    return lines


def _breakdown(b: PlanRow, report: PlanReport) -> str:
    """The row's figures and what stays free (under the advised setting, if any)."""
    needed = b.fits_with.needed_bytes if b.fits_with is not None else b.needed_bytes
    free = report.gpu_memory_bytes - needed
    return (
        f"world size {b.world_size}, micro-batch {b.micro_batch}, checkpointing "
        f"{b.checkpointing} ({b.micro_batch * b.seq_len} tokens per rank): {_figures(b)}; "
        f"{human_bytes(free)} free of {human_bytes(report.gpu_memory_bytes)} (margin "
        f"{human_bytes(report.margin_bytes)})"
    )


def to_markdown(report: PlanReport) -> str:
    parts = []
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        parts += [f"**checkpointing {ck}**", "", markdown_table(headers, body), ""]
    timed = time_section(report)
    if timed is not None:
        parts += [f"**{timed.title}**", "", markdown_table(timed.headers, timed.rows), ""]
    parts += scheme_view.to_markdown(report)
    parts += ["**every cell**", "", markdown_table(*cells(report)), ""]
    parts += [*(f"- {line}" for line in summary_lines(report))]
    parts += ["", *(f"- {n}" for n in report.notes), ""]
    return "\n".join(parts)


def cells(report: PlanReport) -> tuple[list[str], list[list[str]]]:
    """One line per cell: every figure of the fit."""
    parts = [p.name for p in report.rows[0].outside] if report.rows else []
    headers = [
        "world size",
        "micro-batch",
        "checkpointing",
        "allocated",
        "reserved",
        "fragmentation",
        *parts,
        "needed",
        "verdict",
    ]
    body = [
        [
            str(r.world_size),
            str(r.micro_batch),
            r.checkpointing,
            human_bytes(r.peak_bytes),
            human_bytes(r.reserved_bytes) + ("" if r.reserved_replayed else " ~"),
            human_bytes(r.fragmentation_bytes),
            *(human_bytes(p.bytes) for p in r.outside),
            human_bytes(r.needed_bytes),
            ADVISED if r.fits_with is not None else MARK[r.fits],
        ]
        for r in report.rows
    ]
    return headers, body


def to_rich(report: PlanReport) -> list:
    from rich.table import Table
    from rich.text import Text

    tables = []
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        title = f"Will it fit? needed per rank, checkpointing {ck}"
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="right" if i else "left")
        for row in body:
            # a cell never breaks between its size and its verdict; a header may
            table.add_row(*(Text(c, style=_style(c), no_wrap=True) for c in row))
        tables.append(table)
    timed = time_section(report)
    if timed is not None:
        from .formatting import section_table

        tables.append(section_table(timed))
    notes = [*summary_lines(report), *report.notes]
    return [*tables, *scheme_view.to_rich(report), *(Text(f"  {n}") for n in notes)]


def _style(cell: str) -> str:
    if cell.endswith(MARK[True]):
        return "green"
    return "yellow" if cell.endswith(ADVISED) else "red" if cell.endswith(MARK[False]) else ""


def plan_page(report: PlanReport) -> str:
    from .html_base import page
    from .html_charts import plan_heatmap

    title = f"yafsdp plan · {report.source}"
    subtitle = f"{report.seq_len} tokens · {report.param_dtype} · {report.optimizer}"
    from .html_base import esc, section_html

    items = "".join(f"<li>{esc(line)}</li>" for line in (*summary_lines(report), *report.notes))
    body = plan_heatmap(heatmap_data(report)) + f'<section id="fit"><ul>{items}</ul></section>'
    nav = [("plan", "will it fit"), ("fit", "figures")]
    timed = time_section(report)
    if timed is not None:
        body += f'<section id="time">{section_html(timed)}</section>'
        nav.append(("time", "how fast"))
    body += scheme_view.to_html(report)
    return page(title, subtitle, tuple(nav), body)
