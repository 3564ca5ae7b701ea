"""Charts of the page that are not bars: the profile's memory over the step, and the
plan's fits grid as a heat map (the hook for ``yafsdp plan``'s page).

The memory chart draws each step's ``PhaseSeries`` (the profiling result's own
samples: the lowest and highest total of each stretch of events, so the peak is
always a drawn point). The x axis is the step's allocation and free events: one
band per phase, as wide as the busier of the two steps made that phase (at least
a tenth of the chart), each step stretched over the band, so original and
converted line up phase by phase.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .formatting import human_bytes
from .html_base import esc, num, x

PHASES = ("forward", "backward", "optimizer")
VARIANTS = (("original", "#4c78a8"), ("converted", "#f58518"))
W, H, LEFT, RIGHT, TOP, BOTTOM = 1000, 340, 74, 16, 28, 30
MIN_BAND = 0.1
_POWERS = (("B", 1), ("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3), ("TiB", 1024**4))


def timeline_svg(steps: Sequence) -> str:
    """``steps``: the ``StepProfile``s (original, converted) with their ``series``."""
    series = [{s.phase: s for s in step.series} for step in steps]
    if not any(series):
        return '<p class="caption">no memory series in this profile</p>'
    bands = _bands(series)
    top = max(p[1] for ser in series for s in ser.values() for p in s.points) or 1
    unit, step = nice_step(top * 1.05)
    ymax = step * math.ceil(top * 1.05 / step)
    out = [f'<svg class="chart timeline" viewBox="0 0 {W} {H}" role="img">']
    out += _grid(bands, ymax, step, unit)
    for (variant, colour), ser, prof in zip(VARIANTS, series, steps):
        out += _variant(variant, colour, ser, bands, ymax, prof)
    out.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{c}"></i>{v}</span>' for v, c in VARIANTS[: len(steps)]
    )
    return "".join(out) + f'<div class="legend" style="margin-left:{LEFT}px">{legend}</div>'


def _bands(series) -> list[tuple[str, float, float]]:
    """(phase, x0, width) in chart units."""
    phases = [p for p in PHASES if any(p in s for s in series)]
    weights = [max((s[p].events for s in series if p in s), default=1) for p in phases]
    total = sum(weights) or 1
    shares = [max(w / total, MIN_BAND) for w in weights]
    span, at, out = W - LEFT - RIGHT, float(LEFT), []
    for p, share in zip(phases, shares):
        width = span * share / sum(shares)
        out.append((p, at, width))
        at += width
    return out


def nice_step(top: float) -> tuple[tuple[str, int], float]:
    """A binary unit for ``top`` bytes and a tick step (bytes) of 1, 2 or 5 x 10^k of it,
    about five ticks up to ``top``."""
    unit = next((u for u in reversed(_POWERS) if top >= u[1]), _POWERS[0])
    raw = top / unit[1] / 5
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    factor = next((f for f in (1, 2, 5, 10) if f * mag >= raw), 10)
    return unit, factor * mag * unit[1]


def _y(v: float, ymax: float) -> float:
    return TOP + (H - TOP - BOTTOM) * (1 - v / ymax)


def _grid(bands, ymax: float, step: float, unit) -> list[str]:
    out = []
    for i in range(int(round(ymax / step)) + 1):
        v = i * step
        yy = x(_y(v, ymax))
        label = f"{v / unit[1]:g} {unit[0]}"
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{yy}" y2="{yy}" stroke="#e5e8eb"/>'
            f'<text x="{LEFT - 8}" y="{yy}" text-anchor="end" dy="4">{esc(label)}</text>'
        )
    for phase, x0, width in bands:
        out.append(
            f'<line x1="{x(x0)}" x2="{x(x0)}" y1="{TOP - 12}" y2="{H - BOTTOM}" '
            'stroke="#9aa4ae" stroke-dasharray="3 3"/>'
            f'<text x="{x(x0 + width / 2)}" y="{TOP - 10}" text-anchor="middle">'
            f"{esc(phase)}</text>"
        )
    out.append(
        f'<text x="{x((W + LEFT) / 2)}" y="{H - 8}" text-anchor="middle">allocations and '
        "frees of the step, in order (each phase stretched to its band)</text>"
    )
    return out


def _variant(variant, colour, ser, bands, ymax, prof) -> list[str]:
    pts: list[tuple[float, float, int, str]] = []
    for phase, x0, width in bands:
        s = ser.get(phase)
        if s is None:
            continue
        last = max(s.events - 1, 1)
        pts += [(x0 + width * i / last, _y(v, ymax), v, phase) for i, v in s.points]
    if not pts:
        return []
    line = "M" + "L".join(f"{x(a)} {x(b)}" for a, b, _, _ in pts)
    base = x(_y(0, ymax))
    area = f"{line}L{x(pts[-1][0])} {base}L{x(pts[0][0])} {base}Z"
    peak = max(pts, key=lambda p: p[2])
    label = f"{variant} peak {human_bytes(peak[2])} ({peak[3]})"
    anchor = "end" if peak[0] > W * 0.7 else "start"
    dx = -8 if anchor == "end" else 8
    return [
        f'<path d="{area}" fill="{colour}" fill-opacity="0.12"/>',
        f'<path class="series" d="{line}" fill="none" stroke="{colour}" stroke-width="1.8" '
        f'data-variant="{variant}" data-peak="{peak[2]}" data-reported-peak="{prof.peak.total}"/>',
        f'<circle cx="{x(peak[0])}" cy="{x(peak[1])}" r="4" fill="{colour}">'
        f"<title>{esc(label)}: {num(peak[2])} B</title></circle>",
        f'<text x="{x(peak[0] + dx)}" y="{x(peak[1] - 6)}" text-anchor="{anchor}" '
        f'style="fill:{colour};font-weight:600">{esc(label)}</text>',
    ]


# ---------------------------------------------------------------- plan (hook)


def plan_heatmap(plan: Mapping) -> str:
    """The plan's fits grid as a heat map: the hook for ``yafsdp plan --html``.

    ``plan`` is JSON-like data (``plan_view.heatmap_data``), each cell's figures and
    colour from its ``memory.headroom.Fit``::

        {"gpu_memory_bytes": 85899345920,
         "cells": [{"world_size": 8, "micro_batch": 1, "checkpointing": "none",
                    "peak_bytes": 64424509440, "share": 0.75, "level": "fits",
                    "verdict": "fits"},
                   ...]}

    Rows are world sizes, columns (micro-batch, checkpointing) choices; a cell is
    what the GPU must hold per rank (``peak_bytes``, ``share`` of the GPU: the Fit's
    ``needed`` and ``share``), coloured by ``level`` (a Fit's verdict: green fits,
    amber tight, red over). With a ``verdict`` word (the plan's: fits, fits* = fits
    under another allocator setting, OOM) the cell shows it as the terminal does and
    the legend reads the plan's margin; without, the legend reads
    ``headroom.fit_by_share``'s 80% of the GPU. The chart compares no figure itself.
    """
    limit = int(plan["gpu_memory_bytes"])
    cells = list(plan["cells"])
    rows = sorted({int(c["world_size"]) for c in cells})
    cols = list(dict.fromkeys(_column(c) for c in cells))
    at = {(int(c["world_size"]), _column(c)): c for c in cells}
    head = "".join(f"<th>micro-batch {mb}<br>{esc(ck)}</th>" for mb, ck in cols)
    body = []
    for ws in rows:
        tds = "".join(_heat_cell(at.get((ws, col))) for col in cols)
        body.append(f'<tr><th class="r">{ws} GPU{"" if ws == 1 else "s"}</th>{tds}</tr>')
    verdicts = any("verdict" in c for c in cells)
    legend = "".join(
        f'<span><i style="background:{HEAT[k]}"></i>{esc(text)}</span>'
        for k, text in (LEGEND_VERDICT if verdicts else LEGEND_SHARE)
    )
    return (
        f'<section id="plan"><h2>Will it fit? Needed per rank against '
        f"{esc(human_bytes(limit))} of GPU memory</h2>"
        f'<table class="heat"><thead><tr><th></th>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
        f'<div class="legend" style="margin-left:0">{legend}</div></section>'
    )


HEAT = {"fits": "#d7f0dd", "tight": "#fdebc8", "over": "#f9d3d0"}  # a Fit's verdicts
LEGEND_VERDICT = (
    ("fits", "fits, keeping the margin free"),
    ("tight", "fits inside the margin, or fits* only under another allocator setting"),
    ("over", "OOM: above the GPU's memory"),
)
LEGEND_SHARE = (
    ("fits", "below 80% of the GPU"),
    ("tight", "80% to 100%"),
    ("over", "above the GPU's memory"),
)


def _column(cell: Mapping) -> tuple[int, str]:
    """A cell's column: its micro-batch and checkpointing."""
    return int(cell["micro_batch"]), str(cell["checkpointing"])


def _heat_cell(cell) -> str:
    if cell is None:
        return '<td class="cell">-</td>'
    peak = int(cell["peak_bytes"])
    fits = str(cell["level"])
    verdict = cell.get("verdict")
    text = human_bytes(peak) if verdict is None else f"{human_bytes(peak)} {verdict}"
    tip = f"{num(peak)} B, {100 * float(cell['share']):.1f}% of the GPU" + (
        f"; {cell['tip']}" if cell.get("tip") else ""
    )
    return (
        f'<td class="cell {fits}" style="background:{HEAT[fits]}" data-bytes="{peak}" '
        f'title="{esc(tip)}">{esc(text)}</td>'
    )
