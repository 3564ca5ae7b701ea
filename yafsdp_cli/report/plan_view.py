"""``yafsdp plan`` output: the fits grid as a Rich table, markdown, JSON and HTML."""

from __future__ import annotations

from ..planning import SCHEMA, PlanReport, PlanRow
from .formatting import human_bytes, json_document, markdown_table, plain
from .plan_time_view import best_line, time_section

MARK = {True: "fits", False: "OOM"}


def to_json(report: PlanReport) -> str:
    """One ``yafsdp.plan/1`` document: every field of the report, in bytes."""
    payload = plain(report)
    # the options as the command line names them: what ``check`` rebuilds them from
    payload["options"] = plain(report.options.flat()) if report.options else None
    payload["rows"] = [_row_json(r) for r in report.rows]
    payload["best"] = _row_json(report.best) if report.best else None
    payload["linearity"] = [{**plain(c), "error": c.error} for c in report.linearity]
    return json_document(SCHEMA, payload)


def _row_json(row: PlanRow) -> dict:
    doc = plain(row)
    if row.time is not None:
        doc["time"]["exposed_share"] = row.time.exposed_share
    return doc


def heatmap_data(report: PlanReport) -> dict:
    """What ``html_charts.plan_heatmap`` takes: cells coloured by peak + reserve."""
    return {
        "gpu_memory_bytes": report.gpu_memory_bytes,
        "cells": [
            {
                "world_size": r.world_size,
                "micro_batch": r.micro_batch,
                "checkpointing": r.checkpointing,
                "peak_bytes": r.needed_bytes,
            }
            for r in report.rows
        ],
    }


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
    if row is None:
        return "-"
    return f"{human_bytes(row.peak_bytes)} {MARK[row.fits]}"


def summary_lines(report: PlanReport) -> list[str]:
    tokens = f"{report.seq_len} tokens per sequence"
    lines = [
        f"{report.source}: peak per rank against {human_bytes(report.gpu_memory_bytes)} "
        f"per GPU ({human_bytes(report.reserve_bytes)} reserved for CUDA context and NCCL), "
        f"{tokens}, {report.param_dtype} parameters, gradients in {report.grad_dtype}, "
        f"{report.optimizer} ({report.optimizer_impl})",
    ]
    for s in report.smallest:
        where = f"world size {s.world_size}" if s.world_size else "no world size in the grid"
        lines.append(
            f"smallest that fits, micro-batch {s.micro_batch}, checkpointing "
            f"{s.checkpointing}: {where}"
        )
    if report.best is None:
        lines.append("best: nothing in the grid fits")
    else:
        b = report.best
        lines.append(
            f"best: world size {b.world_size}, micro-batch {b.micro_batch}, checkpointing "
            f"{b.checkpointing} ({b.micro_batch * b.seq_len} tokens per rank, peak "
            f"{human_bytes(b.peak_bytes)} + reserve = {human_bytes(b.needed_bytes)})"
        )
    fastest = best_line(report)
    if fastest:
        lines.append(fastest)
    return lines


def to_markdown(report: PlanReport) -> str:
    parts = []
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        parts += [f"**checkpointing {ck}**", "", markdown_table(headers, body), ""]
    timed = time_section(report)
    if timed is not None:
        parts += [f"**{timed.title}**", "", markdown_table(timed.headers, timed.rows), ""]
    parts += [*(f"- {line}" for line in summary_lines(report))]
    parts += ["", *(f"- {n}" for n in report.notes), ""]
    return "\n".join(parts)


def to_rich(report: PlanReport) -> list:
    from rich.table import Table
    from rich.text import Text

    tables = []
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        title = f"Will it fit? peak per rank, checkpointing {ck}"
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
    return [*tables, *(Text(f"  {n}") for n in notes)]


def _style(cell: str) -> str:
    return "green" if cell.endswith(MARK[True]) else "red" if cell.endswith(MARK[False]) else ""


def plan_page(report: PlanReport) -> str:
    from .html_base import page
    from .html_charts import plan_heatmap

    title = f"yafsdp plan · {report.source}"
    subtitle = f"{report.seq_len} tokens · {report.param_dtype} · {report.optimizer}"
    body = plan_heatmap(heatmap_data(report))
    nav = [("plan", "will it fit")]
    timed = time_section(report)
    if timed is not None:
        from .html_base import section_html

        body += f'<section id="time">{section_html(timed)}</section>'
        nav.append(("time", "how fast"))
    return page(title, subtitle, tuple(nav), body)
