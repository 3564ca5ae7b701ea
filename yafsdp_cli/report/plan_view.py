"""``yafsdp plan`` output: the fits grid as a Rich table, markdown, JSON and HTML.

Every verdict and free figure shown is a row's ``Fit`` (``memory.headroom.fit``): the
views name it (``WORD``) and colour it, and compare no figure themselves.
"""

from __future__ import annotations

from ..memory.headroom import FITS, OVER, TIGHT, Fit
from ..planning import SCHEMA, PlanReport, PlanRow
from ..planning.cell import Cell
from . import scheme_view
from .formatting import (
    AnswerText,
    answer_markdown,
    human_bytes,
    json_document,
    markdown_table,
    plain,
)
from .plan_time_view import WHY_BEST, best_line, bound_line, seconds, time_section

MARK = {True: "fits", False: "OOM"}
WORD = {FITS: MARK[True], TIGHT: MARK[True], OVER: MARK[False]}  # a verdict, as a cell says it
ADVISED = "fits*"  # fits only under another allocator setting (the legend names it)


def to_json(report: PlanReport) -> str:
    """One ``yafsdp.plan/1`` document: every field of the report, in bytes."""
    payload = {"answer": answer(report), **plain(report)}
    # the options as the command line names them: what ``check`` rebuilds them from
    payload["options"] = plain(report.options.recorded()) if report.options else None
    payload["rows"] = [_row_json(r) for r in report.rows]
    payload["best"] = _row_json(report.best) if report.best else None
    payload["schemes"] = scheme_view.payload(report)
    # yafsdp.plan/1 keeps these for its readers: every cell is measured and replayed
    # from its own step, so no cell is carried on a line and none checked against one
    payload["linearity"] = []
    payload["reserved_checks"] = []
    return json_document(SCHEMA, payload)


def _row_json(row: PlanRow) -> dict:
    doc = plain(row)
    doc["measured"] = doc["reserved_replayed"] = True  # for yafsdp.plan/1's readers
    if row.time is not None:
        doc["time"]["exposed_share"] = row.time.exposed_share
    return doc


def heatmap_data(report: PlanReport) -> dict:
    """What ``html_charts.plan_heatmap`` takes: each cell's needed bytes (reserved
    peak + the memory beside the allocator), its share of the GPU, its verdict word,
    its colour (``level``) and its figures."""
    return {
        "gpu_memory_bytes": report.gpu_memory_bytes,
        "cells": [
            {
                "world_size": r.world_size,
                "micro_batch": r.micro_batch,
                "checkpointing": r.checkpointing,
                "peak_bytes": _shown(r)[0].needed,
                "share": _shown(r)[0].share,
                "verdict": _shown(r)[1],
                "level": _level(r),
                "tip": _figures(r),
            }
            for r in report.rows
        ],
    }


def _shown(row: PlanRow) -> tuple[Fit, str]:
    """What a cell shows: its fit (under the setting it fits with, if any) and the
    terminal's verdict word."""
    if row.fits_with is not None:
        return row.fits_with.fit, ADVISED
    return row.fit, WORD[row.fit.verdict]


def _level(row: PlanRow) -> str:
    """A cell's colour: its verdict; a cell that fits only under another allocator
    setting is amber, as one inside the margin is."""
    return TIGHT if row.fits_with is not None else row.fit.verdict


def _figures(r: PlanRow) -> str:
    """A cell's figures in one line: allocated, reserved, each part beside, needed."""
    beside = " + ".join(f"{p.name} {human_bytes(p.bytes)}" for p in r.outside if p.bytes)
    text = (
        f"allocated {human_bytes(r.peak_bytes)} + fragmentation "
        f"{human_bytes(r.fragmentation_bytes)} = reserved {human_bytes(r.reserved_bytes)}"
        + (f"; + {beside}" if beside else "")
        + f" = needed {human_bytes(r.needed_bytes)}"
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
    at = {r.cell: r for r in report.rows}
    # "GPUs", the world size: a narrow first column leaves 80 columns room for four cells
    headers = ["GPUs", *(f"micro-batch {mb}" for mb in report.micro_batches)]
    body = [
        [
            str(ws),
            *(_cell(at.get(Cell.at(ws, mb, checkpointing))) for mb in report.micro_batches),
        ]
        for ws in report.world_sizes
    ]
    return headers, body


def _cell(row: PlanRow | None) -> str:
    """What the GPU must hold, and the verdict (``cells`` has every figure)."""
    if row is None:
        return "-"
    shown, word = _shown(row)
    return f"{human_bytes(shown.needed)} {word}"


def answer(report: PlanReport) -> list[str]:
    """The plan's answer in at most five lines, before any table: the fewest GPUs
    that fit, the recommended configuration with its headroom and why, what the
    ``--tokens`` cost on it, a better one under another allocator setting, and what
    was assumed (the fine-tuning's adapter, quantized base and frozen parameters
    too, the estimated ones said to be)."""
    lines = [_fewest(report), _recommended(report)]
    t = report.timing
    if t is not None and t.gpu_hours is not None and report.best is not None:
        lines.append(
            f"{_count(t.tokens)} tokens: {_hours(t.gpu_hours)} GPU-hours, {_hours(t.wall_hours)} h "
            f"on {_gpus(report.best.world_size)}"
        )
    if report.advice is not None:
        a = report.advice.row
        lines.append(
            f"with {report.advice.export}: world size {a.world_size}, micro-batch "
            f"{a.micro_batch}, checkpointing {a.checkpointing} fits too (needed "
            f"{human_bytes(a.fits_with.needed_bytes)})"
        )
    alloc = report.alloc_conf or "none (--target cpu)"
    past = report.past_positions
    beyond = (
        f" (past the {past.positions} positions the model was trained at, config {past.key})"
        if past is not None
        else ""
    )
    accum = (
        f", {report.grad_accum} micro-batches per optimizer step (--grad-accum)"
        if report.grad_accum > 1
        else ""
    )
    lines.append(
        f"assumed: {report.seq_len} tokens per sequence{beyond}{accum}, {report.param_dtype} "
        f"parameters (--param-dtype), {report.optimizer}, loss {report.loss}, allocator settings "
        f"{alloc}, flat scheme" + "".join(f", {t}" for t in report.tuning)
    )
    return lines


def _gpus(n: int) -> str:
    return "1 GPU" if n == 1 else f"{n} GPUs"


def _hours(h: float) -> str:
    """Whole hours, and two figures below ten (a small model's budget takes minutes)."""
    return f"{h:,.0f}" if h >= 10 else f"{h:.2g}"


def _count(n: int) -> str:
    """``10**12`` -> ``"1T"``, ``3 * 10**11`` -> ``"300B"``: as ``--tokens`` writes it."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + suffix
    return f"{n:,}"


def _fewest(report: PlanReport) -> str:
    fitting = [s for s in report.smallest if s.world_size is not None]
    if not fitting:
        low = min(report.rows, key=lambda r: r.needed_bytes, default=None)
        if low is None:
            return "nothing planned"
        return (
            f"nothing fits on {human_bytes(report.gpu_memory_bytes)} per GPU: at least "
            f"{human_bytes(low.needed_bytes)} per rank (world size {low.world_size}, "
            f"micro-batch {low.micro_batch}, checkpointing {low.checkpointing})"
        )
    first = min(fitting, key=lambda s: (s.world_size, -s.micro_batch, s.checkpointing != "none"))
    return (
        f"fewest GPUs: {first.world_size}, at micro-batch {first.micro_batch} with "
        f"checkpointing {first.checkpointing}"
    )


def _recommended(report: PlanReport) -> str:
    b, gpu = report.best, report.gpu_memory_bytes
    margin = human_bytes(report.margin_bytes)
    if b is None:
        return f"recommended: none, nothing in the grid keeps the margin of {margin} free"
    shown = _shown(b)[0]
    head = (
        f"recommended: world size {b.world_size}, micro-batch {b.micro_batch}, checkpointing "
        f"{b.checkpointing}, needed {human_bytes(shown.needed)} of {human_bytes(gpu)} "
        f"({human_bytes(shown.free)} free)"
    )
    t = report.timing
    if t is None or b.time is None:
        return f"{head}: the most tokens per rank keeping {margin} free (--gpu NAME ranks by speed)"
    why = WHY_BEST[t.objective]
    return (
        f"{head}: {b.time.tokens_per_s:,.0f} tokens/s per GPU, {seconds(b.time.step_s)} "
        f"a step on {t.gpu}, MFU {b.time.mfu:.1%}; {why}"
    )


def summary_lines(report: PlanReport) -> list[str]:
    tokens = f"{report.seq_len} tokens per sequence"
    if report.grad_accum > 1:
        tokens += f", {report.grad_accum} micro-batches accumulated per optimizer step"
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
    goes = bound_line(report)
    if goes:
        lines.append(goes)
    return lines


def _breakdown(b: PlanRow, report: PlanReport) -> str:
    """The row's figures and what stays free (under the advised setting, if any)."""
    free = _shown(b)[0].free
    n = report.grad_accum
    tokens = f"{b.micro_batch * b.seq_len} tokens per rank"
    if n > 1:
        where = "" if b.peak_phase == "optimizer" else f" of micro-batch {b.peak_micro_batch}"
        tokens = (
            f"{b.micro_batch * b.seq_len} tokens per micro-batch, {n * b.micro_batch * b.seq_len}"
            f" per rank and step; peak in the {b.peak_phase}{where}"
        )
    return (
        f"world size {b.world_size}, micro-batch {b.micro_batch}, checkpointing "
        f"{b.checkpointing} ({tokens}): {_figures(b)}; "
        f"{human_bytes(free)} free of {human_bytes(report.gpu_memory_bytes)} (margin "
        f"{human_bytes(report.margin_bytes)})"
    )


def to_markdown(report: PlanReport) -> str:
    """A document for a pull request or a wiki: the answer, the tables, and every
    summary line and note (``--explain`` shortens only the terminal's)."""
    parts = [answer_markdown(answer(report))]
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        parts += [f"**checkpointing {ck}**", "", markdown_table(headers, body), ""]
    timed = time_section(report)
    if timed is not None:
        parts += [f"**{timed.title}**", "", markdown_table(timed.headers, timed.rows), ""]
    parts += scheme_view.to_markdown(report)
    parts += ["**every cell**", "", markdown_table(*cells(report)), ""]
    parts += [f"- {line}" for line in _notes(report, explain=True)]
    return "\n".join([*parts, ""])


def _notes(report: PlanReport, explain: bool) -> list[str]:
    """Every summary line and method note with ``explain``; else the legend and a
    pointer to them."""
    every = [*summary_lines(report), *report.notes]
    if explain:
        return every
    legend = [line for line in summary_lines(report)[1:] if line.startswith(ADVISED)]
    return [*legend, f"{len(every)} more lines on the figures and the method: --explain"]


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
            human_bytes(r.reserved_bytes),
            human_bytes(r.fragmentation_bytes),
            *(human_bytes(p.bytes) for p in r.outside),
            human_bytes(r.needed_bytes),
            _shown(r)[1],
        ]
        for r in report.rows
    ]
    return headers, body


def to_rich(report: PlanReport, *, explain: bool = False) -> list:
    """The answer, the tables, and the legend; with ``explain`` every summary line
    and method note as well (JSON and markdown always carry them)."""
    from rich.text import Text

    from .fit_table import fit_table

    tables: list = [AnswerText(answer(report))]
    for ck in report.checkpointing:
        headers, body = grid(report, ck)
        title = Text(f"Will it fit? needed per rank, checkpointing {ck}", style="italic")
        rows = [[Text(c, style=_style(c)) for c in row] for row in body]
        # no vertical rules: four cells of "1009.81 MiB fits*" fit in 80 columns; a cell
        # never breaks between its size and its verdict (a header may)
        whole = range(1, len(headers))
        right = range(1, len(headers))
        tables.append(fit_table(title, headers, rows, right=right, whole=whole, simple=True))
    timed = time_section(report)
    if timed is not None:
        from .formatting import section_table

        tables.append(section_table(timed))
    notes = _notes(report, explain)
    schemes = scheme_view.to_rich(report, explain=explain)
    return [*tables, *schemes, *(Text(f"  {n}") for n in notes)]


def _style(cell: str) -> str:
    if cell.endswith(MARK[True]):
        return "green"
    return "yellow" if cell.endswith(ADVISED) else "red" if cell.endswith(MARK[False]) else ""


def plan_page(report: PlanReport) -> str:
    """The answer, the heat map with its legend (a cell's figures on hover), the time
    table and schemes, then every summary line and note."""
    from .html_base import esc, page, section_html
    from .html_charts import plan_heatmap

    title = f"yafsdp plan · {report.source}"
    subtitle = f"{report.seq_len} tokens · {report.param_dtype} · {report.optimizer}"
    if report.grad_accum > 1:
        subtitle += f" · {report.grad_accum} micro-batches per step"
    first, *rest = answer(report)
    ok = "pass" if report.best is not None else "fail"
    summary = (
        f'<section id="answer"><p class="verdict {ok}">{esc(first)}</p>'
        f"<ul>{''.join(f'<li>{esc(line)}</li>' for line in rest)}</ul></section>"
    )
    items = "".join(f"<li>{esc(line)}</li>" for line in (*summary_lines(report), *report.notes))
    body = summary + plan_heatmap(heatmap_data(report))
    nav = [("answer", "answer"), ("plan", "will it fit")]
    timed = time_section(report)
    if timed is not None:
        body += f'<section id="time">{section_html(timed)}</section>'
        nav.append(("time", "how fast"))
    body += scheme_view.to_html(report)
    body += f'<section id="fit"><h2>Figures and method</h2><ul>{items}</ul></section>'
    nav.append(("fit", "figures and method"))
    return page(title, subtitle, tuple(nav), body)
