"""A compact stacked bar chart for the terminal: one row per scheme (or variant).

Each row is the bytes one rank holds, split by category, drawn to one scale (the
largest row fills the width). Colour is Rich's to drop: on a console without a
colour system (stdout not a TTY) or with ``NO_COLOR`` set, each category gets its
own glyph instead, so the chart still reads in a CI log; ASCII consoles get ASCII.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from .formatting import human_bytes

# Shared with the HTML page so both speak in the same colours.
PALETTE = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b", "#b279a2")
GLYPHS = ("█", "▓", "▒", "░", "▚", "▞", "▪")
ASCII_GLYPHS = ("#", "=", "%", "+", ":", "~", ".")
LABEL_WIDTH, VALUE_WIDTH = 16, 11


@dataclass(frozen=True, slots=True)
class BarRow:
    label: str
    parts: tuple[int, ...]  # bytes per category, in the chart's category order
    note: str = ""  # printed after the total (e.g. "-97.8%")

    @property
    def total(self) -> int:
        return sum(self.parts)


@dataclass(frozen=True, slots=True)
class StackedBars:
    """A Rich renderable: ``rows`` of stacked ``categories`` (labels)."""

    title: str
    categories: tuple[str, ...]
    rows: tuple[BarRow, ...]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        colour = console.color_system is not None and not console.no_color
        glyphs = ASCII_GLYPHS if options.ascii_only else GLYPHS
        note_width = max((len(r.note) for r in self.rows), default=0)
        width = max(options.max_width - LABEL_WIDTH - VALUE_WIDTH - note_width - 3, 10)
        scale = max((r.total for r in self.rows), default=0)
        yield Text(self.title, style="bold")
        for row in self.rows:
            line = Text(f"{row.label[: LABEL_WIDTH - 1]:<{LABEL_WIDTH}}")
            line.append_text(_bar(row.parts, scale, width, glyphs, colour))
            line.append(f" {human_bytes(row.total):>{VALUE_WIDTH}}")
            if row.note:
                line.append(f" {row.note:>{note_width}}", style="dim")
            yield line
        yield _legend(self.categories, glyphs, colour)


def cells(parts: Sequence[int], scale: int, width: int) -> list[int]:
    """Cells per part: cumulative rounding, so the row's length is its share of
    ``scale`` and no rounding error piles up along it."""
    if scale <= 0:
        return [0] * len(parts)
    out, done, ends = [], 0, 0
    for p in parts:
        done += p
        end = round(done * width / scale)
        out.append(end - ends)
        ends = end
    return out


def _bar(parts, scale, width, glyphs, colour) -> Text:
    text = Text()
    for i, n in enumerate(cells(parts, scale, width)):
        if n:
            glyph = glyphs[0] if colour else glyphs[i % len(glyphs)]
            text.append(glyph * n, style=PALETTE[i % len(PALETTE)] if colour else "")
    used = sum(cells(parts, scale, width))
    text.append(" " * (width - used))
    return text


def _legend(categories, glyphs, colour) -> Text:
    text = Text()
    for i, label in enumerate(categories):
        glyph = glyphs[0] if colour else glyphs[i % len(glyphs)]
        text.append(glyph, style=PALETTE[i % len(PALETTE)] if colour else "")
        text.append(f" {label} ", style="dim")
    return text
