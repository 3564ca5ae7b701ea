"""Formatting shared by every report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.50 KiB"`` (powers of 1024; GiB = 1024**3)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def human_count(n: int) -> str:
    """``7_000_000_000`` -> ``"7.00B"`` (decimal, for element counts)."""
    for size, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= size:
            return f"{n / size:.2f}{suffix}"
    return str(n)


def plain(obj: Any) -> Any:
    """Dataclasses, tuples, paths -> JSON-able builtins."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
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
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(map(cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def rich_table(
    title: str | None,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    right: Sequence[int] = (),
) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for i, h in enumerate(headers):
        table.add_column(h, justify="right" if i in right else "left")
    for r in rows:
        table.add_row(*(str(v) for v in r))
    return table


@dataclass(frozen=True, slots=True)
class Section:
    """One table of a report: a title, headers, rows, right-aligned columns, a caption."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: tuple[int, ...] = ()  # right-aligned columns
    caption: str = ""


def section_table(s: Section) -> Table:
    """A Rich table of ``s``; cells are Text, not markup (names hold brackets)."""
    from rich.text import Text

    table = Table(
        title=Text(s.title, style="bold"),
        title_justify="left",
        header_style="bold",
        caption=Text(s.caption) if s.caption else None,
        caption_justify="left",
        show_header=any(s.headers),
    )
    for i, h in enumerate(s.headers):
        table.add_column(Text(h), justify="right" if i in s.right else "left", overflow="fold")
    for row in s.rows:
        table.add_row(*(Text(cell) for cell in row))
    return table


def section_markdown(s: Section, escape=lambda t: t) -> str:
    """``### title``, the table, and the caption in italics."""
    headers = s.headers if any(s.headers) else ("",) * max((len(r) for r in s.rows), default=1)
    text = f"### {escape(s.title)}\n\n{markdown_table(headers, s.rows)}"
    return text + (f"\n\n_{escape(s.caption)}_" if s.caption else "") + "\n"
