"""The layout part of the page: every flat buffer as a bar of its entries and
padding, the rank shards under it, and where a rank boundary cuts a parameter.

Each buffer is one ``<svg class="buffer-bar" data-buffer=NAME>`` whose x axis is
the buffer's padded elements: entry ``e`` is the rect over
``[e.offset, e.offset + e.numel)``, the hatched background is padding, the strip
below alternates rank by rank (rank r owns ``flat[r * shard : (r + 1) * shard]``)
and a red tick marks each rank boundary that falls inside a parameter. Buffers
with the same layout (one per transformer block) fold as in the terminal: the
first is shown, the rest sit in a ``<details>`` that expands them.
"""

from __future__ import annotations

import bisect

from ..engine import dtypes
from ..engine.layout import FlatEntry
from ..inspection.build import BufferInfo, InspectReport
from .formatting import human_bytes
from .html_base import WIDTH, esc, num, section_html, x
from .inspect_view import buffer_section, shard_section

# Entry colours by position, so neighbours differ and q_proj is one colour in every block.
ENTRY_COLORS = (
    "#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2",
    "#b279a2", "#eeca3b", "#9d755d", "#ff9da6", "#79706e",
)  # fmt: skip
BAR_H, STRIP_Y, STRIP_H = 30, 34, 12
CUT_H = 9  # cut ticks hang from the bar's top edge, like a ruler's
LABEL_MIN = 0.05  # entries narrower than this share of the bar get no label
RANK_LABELS_MAX = 32  # ranks numbered on the strip up to this world size


def layout_section(report: InspectReport) -> str:
    """Every buffer, grouped; the first of each group shown, the others folded."""
    n = len(report.buffers)
    parts = [
        '<section id="layout"><h2>Flat buffers</h2>'
        f'<p class="caption">{n} buffers; each bar is one buffer, its entries in order '
        "(hatched: padding). "
        + _rank_caption(report)
        + " Hover for the parameter and the rank under the cursor.</p>"
    ]
    for group in report.groups:
        first, others = group.members[0], group.members[1:]
        parts.append('<div class="group">')
        parts.append(buffer_figure(report, first))
        parts.append(_tables(report, first, others))
        if others:
            names = [report.buffers[i].unit or report.buffers[i].name for i in others]
            span = names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"
            parts.append(
                f'<details class="more"><summary>+{len(others)} more buffers with this '
                f"layout: {esc(span)}</summary>"
                + "".join(buffer_figure(report, i) for i in others)
                + "</details>"
            )
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


def _rank_caption(report: InspectReport) -> str:
    ws = report.inputs.world_size
    if ws == 1:
        return "World size 1: nothing is sharded."
    return (
        f"The strip under each bar alternates rank by rank ({ws} ranks: rank r owns "
        "flat[r × shard : (r + 1) × shard]); a red tick is a rank boundary that cuts a "
        "parameter in two."
    )


def _tables(report: InspectReport, index: int, others) -> str:
    entries = section_html(buffer_section(report, index, others, True), "entries")
    out = f"<details><summary>entries table</summary>{entries}</details>"
    if report.inputs.world_size > 1:
        shards = section_html(shard_section(report, index, False), "shards")
        out += f"<details><summary>shard map</summary>{shards}</details>"
    return out


def buffer_figure(report: InspectReport, index: int) -> str:
    b = report.buffers[index]
    ws = report.inputs.world_size
    cuts = cut_points(b, ws)
    facts = _facts(b, ws, len(cuts))
    svg = (
        f'<svg class="buffer-bar" viewBox="0 0 {WIDTH} {STRIP_Y + STRIP_H}" '
        f'preserveAspectRatio="none" data-buffer="{esc(b.name)}" data-numel="{b.numel}" '
        f'data-padded="{b.padded_numel}" data-shard="{b.shard_numel}" data-ws="{ws}">'
        f'<rect width="{WIDTH}" height="{BAR_H}" fill="url(#hatch)"/>'
        + "".join(_entry_rect(b, e, i) for i, e in enumerate(b.entries))
        + _cut_path(b, cuts)
        + _rank_strip(ws)
        + "</svg>"
    )
    labels = _labels(b) + _rank_labels(ws)
    bar = f'<div class="bar-wrap">{svg}{labels}</div>'
    return f'<div class="buf">{facts}{bar}{_axis(b, ws)}</div>'


def _axis(b: BufferInfo, ws: int) -> str:
    if ws <= RANK_LABELS_MAX:
        return ""
    return (
        f'<div class="buf-axis"><span>rank 0</span><span>{ws} ranks × '
        f"{num(b.shard_numel)} elements</span><span>rank {ws - 1}</span></div>"
    )


def _short(b: BufferInfo, name: str) -> str:
    return name[len(b.unit) + 1 :] if b.unit and name.startswith(b.unit + ".") else name


def _labels(b: BufferInfo) -> str:
    """Names over the entries wide enough to hold one (HTML over the stretched SVG)."""
    if not b.padded_numel:
        return ""
    spans = [
        f'<span style="left:{100 * e.offset / b.padded_numel:.3f}%;'
        f'width:{100 * e.numel / b.padded_numel:.3f}%">{esc(_short(b, e.name))}</span>'
        for e in b.entries
        if e.numel >= LABEL_MIN * b.padded_numel
    ]
    return f'<div class="labels">{"".join(spans)}</div>' if spans else ""


def _rank_labels(ws: int) -> str:
    if ws == 1:
        return ""
    if ws > RANK_LABELS_MAX:
        return ""
    ranks = range(ws)
    spans = "".join(
        f'<span style="left:{100 * r / ws:.3f}%;width:{100 / ws:.3f}%">{r}</span>' for r in ranks
    )
    return f'<div class="rank-labels">{spans}</div>'


def _facts(b: BufferInfo, ws: int, cut_count: int) -> str:
    frozen = " · frozen" if not b.requires_grad else ""
    shard = ""
    if ws > 1:
        per_rank = b.shard_numel * dtypes.itemsize(b.dtype)
        shard = (
            f' · <span data-f="shard_numel">{num(b.shard_numel)}</span> per rank '
            f"({esc(human_bytes(per_rank))}), {cut_count} of {ws - 1} rank boundaries "
            "inside a parameter"
        )
    return (
        f'<div class="buf-head"><span class="buf-name">{esc(b.name)}</span>'
        f'<span class="buf-facts">{esc(dtypes.short(b.dtype))}{frozen} · '
        f'<span data-f="entries">{len(b.entries)}</span> entries · '
        f'<span data-f="numel">{num(b.numel)}</span> elements · padded to '
        f'<span data-f="padded_numel">{num(b.padded_numel)}</span> '
        f'(+<span data-f="padding_numel">{num(b.padding_numel)}</span>) · '
        f"{esc(human_bytes(b.bytes))}{shard}</span></div>"
    )


def _entry_rect(b: BufferInfo, e: FlatEntry, i: int) -> str:
    scale = WIDTH / b.padded_numel if b.padded_numel else 0.0
    first = e.offset // b.shard_numel if b.shard_numel else 0
    last = (e.offset + max(e.numel, 1) - 1) // b.shard_numel if b.shard_numel else 0
    shape = "(" + ", ".join(map(str, e.shape)) + ("," if len(e.shape) == 1 else "") + ")"
    lines = [
        e.name,
        f"shape {shape} · {dtypes.short(e.dtype)} · offset {num(e.offset)} · "
        f"{num(e.numel)} elements",
    ]
    if e.aliases:
        lines.append("aliases: " + ", ".join(e.aliases))
    if b.padded_numel != b.shard_numel:
        lines.append(f"rank {first}" if first == last else f"cut across ranks {first}–{last}")
    return (
        f'<rect class="e" x="{x(e.offset * scale)}" width="{x(e.numel * scale)}" '
        f'height="{BAR_H}" fill="{ENTRY_COLORS[i % len(ENTRY_COLORS)]}" '
        f'data-o="{e.offset}" data-n="{e.numel}">'
        f"<title>{esc(chr(10).join(lines))}</title></rect>"
    )


def cut_points(b: BufferInfo, ws: int) -> list[int]:
    """Rank boundaries (element offsets) that fall strictly inside an entry."""
    if ws == 1 or not b.entries:
        return []
    starts = [e.offset for e in b.entries]
    out = []
    for r in range(1, ws):
        at = r * b.shard_numel
        i = bisect.bisect_right(starts, at) - 1
        if i >= 0 and starts[i] < at < starts[i] + b.entries[i].numel:
            out.append(at)
    return out


def _cut_path(b: BufferInfo, cuts: list[int]) -> str:
    if not cuts:
        return ""
    scale = WIDTH / b.padded_numel
    d = "".join(f"M{x(c * scale)} 0v{CUT_H}" for c in cuts)
    return f'<path class="cut" d="{d}"/>'


def _rank_strip(ws: int) -> str:
    if ws == 1:
        return ""
    step = WIDTH / ws
    d = "".join(
        f"M{x(r * step)} {STRIP_Y}h{x(step)}v{STRIP_H}h-{x(step)}z" for r in range(0, ws, 2)
    )
    return (
        f'<rect class="rank-odd" y="{STRIP_Y}" width="{WIDTH}" height="{STRIP_H}"/>'
        f'<path class="rank-even" d="{d}"/>'
    )
