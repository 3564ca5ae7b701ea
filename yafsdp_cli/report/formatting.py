"""Formatting shared by every report."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Rich is imported when a table is made: --json never needs it
    from rich.text import Text

    from .fit_table import FitTable

from ..errors import printable
from ..schemes import Scheme

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (powers of 1024; GiB = 1024**3)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


_FIGURE = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB)\b")


class AnswerText:
    """A report's first lines, for a Rich console: the first in bold, wrapped at the
    console's width between figures, never inside one ("1.64 MiB" stays on one line;
    Rich's own wrapping breaks at any space, a no-break one included, and textwrap's
    does not break at a no-break space)."""

    def __init__(self, lines: Sequence[str]):
        self.lines = [printable(line) for line in lines if line]

    def __rich_console__(self, console, options):
        import textwrap

        from rich.text import Text

        width = max(options.max_width, 20)
        for i, line in enumerate(self.lines):
            held = _FIGURE.sub("\\1\u00a0\\2", line)
            for part in textwrap.wrap(held, width, break_on_hyphens=False, subsequent_indent="  "):
                part = part.replace("\u00a0", " ")
                yield Text(part, style="bold" if i == 0 else "", no_wrap=True, overflow="fold")
        yield Text("")  # the tables follow


def answer_text(lines: Sequence[str]) -> AnswerText:
    return AnswerText(lines)


def answer_markdown(lines: Sequence[str], escape=lambda t: t) -> str:
    """A report's first lines as one markdown paragraph, one line each."""
    return "  \n".join(escape(printable(line)) for line in lines if line) + "\n"


def human_count(n: int) -> str:
    """``7_000_000_000`` -> ``"7.00B"`` (decimal, for element counts)."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def plain(obj: Any) -> Any:
    """Dataclasses, tuples, paths -> JSON-able builtins; a scheme -> its name (the
    inspect document spells its schemes otherwise: ``inspect_view.to_json``). A
    dataclass field whose metadata says ``{"json": False}`` is left out (a row's
    ``Fit``: the row's own fields give its figures)."""
    if isinstance(obj, Scheme):
        return obj.name
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: plain(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.metadata.get("json", True)
        }
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def json_document(schema: str, payload: dict[str, Any]) -> str:
    """One JSON document: ``{"schema": ..., **payload}``."""
    return json.dumps({"schema": schema, **plain(payload)}, indent=2, allow_nan=False)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:  # a two-line header is one line in markdown
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def unbroken(text: str, **style) -> Text:
    """A line holding a path: Rich would fold a long path mid-name at the console's
    width, so the terminal wraps this line instead and a copied path still works
    (``render`` prints ``no_wrap`` lines with soft wrapping)."""
    from rich.text import Text

    return Text(text, no_wrap=True, **style)


def rich_table(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Sequence[int] = (),
    names: Sequence[int] = (),
) -> FitTable:
    """A table that fits the console's width (``fit_table``); ``names``: columns of
    dotted names, folded to their distinguishing last parts."""
    from .fit_table import fit_table

    return fit_table(title, headers, rows, right=right, names=names)


@dataclass(frozen=True, slots=True)
class Section:
    """One table of a report: a title, headers, rows, right-aligned columns, a caption."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: tuple[int, ...] = ()  # right-aligned columns
    caption: str = ""
    names: tuple[int, ...] = ()  # columns of dotted names: folded to their last parts
    key: tuple[int, ...] = (0,)  # what names a row: repeated in each part of a split table
    rules: bool = True  # rules between the columns (off: the room goes to the cells)


def printable_section(s: Section) -> Section:
    """``s`` with every text escaped for a terminal (``errors.printable``): tensor and
    module names come from the files a report reads. A header's own line breaks (a
    narrow column's heading on two lines) are kept."""
    return dataclasses.replace(
        s,
        title=printable(s.title),
        headers=tuple("\n".join(map(printable, h.split("\n"))) for h in s.headers),
        rows=tuple(tuple(printable(c) for c in row) for row in s.rows),
        caption=printable(s.caption),
    )


def section_table(s: Section, *, fold_names: bool = True) -> FitTable:
    """A table of ``s`` that fits the console's width (``fit_table``): no column
    narrower than its header's and its values' shortest form, no word broken; name
    columns fold to their distinguishing last parts (full with ``fold_names`` off:
    ``--all``, broken after a dot instead). Cells are Text, not markup (names hold
    brackets)."""
    from rich.text import Text

    from .fit_table import fit_table

    s = printable_section(s)
    return fit_table(
        Text(s.title, style="bold"),
        s.headers,
        s.rows,
        right=s.right,
        names=s.names,
        fold_names=fold_names,
        key=s.key,
        caption=s.caption or None,
        simple=not s.rules,
    )


def section_markdown(s: Section, escape=lambda t: t) -> str:
    """``### title``, the table, and the caption in italics."""
    s = printable_section(s)
    headers = s.headers if any(s.headers) else ("",) * max((len(r) for r in s.rows), default=1)
    text = f"### {escape(s.title)}\n\n{markdown_table(headers, s.rows)}"
    return text + (f"\n\n_{escape(s.caption)}_" if s.caption else "") + "\n"
