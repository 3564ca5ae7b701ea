"""Tables that fit the terminal's width, 60 columns or 200, and stay readable.

Rich narrows a table that is too wide by cutting its widest wrappable columns and, as
a last resort, every column evenly: a column can reach zero width, a word breaks
inside a cell (``non-reentr`` / ``ant``), a header is cropped (``st`` for ``step``).
So the layout is done here, and Rich only draws it:

- every column is at least as wide as its *shortest form*: the longest word of its
  header and of its cells. A word is what lies between spaces, a figure and its unit
  kept together (``843.81 MiB``), a shape too (``(4096, 14336)``); a name with a
  slice may break before the slice (``lm_head.weight`` / ``[0:4,096]``), a path
  after a slash;
- a column of names (``names``) folds long names to their last dotted parts
  (``…input_layernorm.weight``), never inside a part, and is as wide as it takes for
  every two different names of the column to stay different;
- columns are narrowed from the widest down, none below its shortest form; cells are
  wrapped here, between words, and handed to Rich already wrapped;
- a table whose shortest forms do not fit is split into parts, each repeating the key
  columns (``key``: the row's name); one that cannot be split so is stacked, a row
  at a time, each value after its header.

The title and the caption are lines of their own, wrapped between words at the
console's width (a table's own title wraps at the table's width, inside words).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

NBSP = "\u00a0"  # a space no line breaks at, while words are found
ELLIPSIS = "…"
NAME_FLOOR = 16  # a folded name column is never narrower (unless its names are)
# a figure and its unit; the spaces of a shape such as (4096, 14336)
_UNIT = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|PiB|ms|s|µs|min|h)(?![\w])")
_SHAPE = re.compile(r"\([\d, ]*\)")
# where a dotted name may break or fold: after a dot that is no decimal point (2.39)
_DOT = re.compile(r"(?<!\d)\.(?=.)|\.(?=\D)")
_SLICE = re.compile(r"(?<=.)\[")  # before a slice: lm_head.weight[0:4,096]


# -------------------------------------------------------------------- words


def glued(text: str) -> str:
    """``text`` with the spaces a line must not break at made no-break spaces."""
    text = _UNIT.sub(f"\\1{NBSP}\\2", text)
    return _SHAPE.sub(lambda m: m.group(0).replace(" ", NBSP), text)


def pieces(text: str, *, dots: bool = False) -> list[tuple[str, str]]:
    """``(separator, piece)`` pairs a line may break between: a space (kept when the
    line goes on), before a slice's ``[``, after a path's ``/`` and, with ``dots``,
    after a dotted name's ``.`` (nothing is printed there when the line goes on)."""
    out: list[tuple[str, str]] = []
    for word in glued(text).split(" "):
        if not word:
            continue
        cuts = [0] + [m.start() for m in _SLICE.finditer(word)]
        if word.count("/") > 1:  # a path: after a slash
            cuts += [m.end() for m in re.finditer(r"/(?=.)", word)]
        if dots:
            cuts += [m.end() for m in _DOT.finditer(word)]
        cuts = sorted(set(cuts)) + [len(word)]
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            out.append((" " if i == 0 and out else "", word[a:b]))
    return out


def shortest(text: str, *, dots: bool = False) -> int:
    """The narrowest width ``text`` wraps to without breaking a word."""
    widths = [len(p) for line in text.split("\n") for _, p in pieces(line, dots=dots)]
    return max(widths, default=0)


def widest(text: str) -> int:
    return max((len(line) for line in text.split("\n")), default=0)


def wrap(text: str, width: int, *, dots: bool = False) -> list[str]:
    """``text`` in lines of at most ``width``, broken between pieces only (a piece
    wider than ``width``, which a layout never asks for, is cut into chunks)."""
    lines: list[str] = []
    for para in text.split("\n"):
        line = ""
        for sep, piece in pieces(para, dots=dots):
            if line and len(line) + len(sep) + len(piece) <= width:
                line += sep + piece
                continue
            if line:
                lines.append(line)
            while len(piece) > width > 0:
                lines.append(piece[:width])
                piece = piece[width:]
            line = piece
        lines.append(line)
    return [line.replace(NBSP, " ") for line in lines]


# -------------------------------------------------------------------- names


_INDEX = re.compile(r"(\d+|\*)(\.|\[|$)")  # a block's index, or any block's


def _starts(text: str) -> list[int]:
    """Where a tail of a dotted name may start: after a dot, or at a slice's ``[``;
    never at a block's index (``layers.1.mlp``, not ``1.mlp``)."""
    dots = {m.end() for m in _DOT.finditer(text) if not _INDEX.match(text, m.end())}
    return sorted(dots | {m.start() for m in _SLICE.finditer(text)})


def fold_name(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: its last dotted parts after ``…``
    (``model.layers.0.self_attn.q_proj.weight`` -> ``…q_proj.weight``), never a part
    cut in two unless even the last part does not fit (a layout never asks that)."""
    if len(text) <= width:
        return text
    for start in _starts(text):
        if len(text) - start <= width - 1:
            return ELLIPSIS + text[start:]
    if width <= 1:
        return ELLIPSIS[:width]
    return ELLIPSIS + text[len(text) - (width - 1) :]


def shortest_names(names: Sequence[str]) -> dict[str, str]:
    """Each name's shortest form that no other name of the column shares: ``…`` and
    its last dotted parts that no other name ends with (``…input_layernorm.weight``
    beside ``…post_attention_layernorm.weight``; a block's index with the word before
    it, ``…layers.1.mlp.up_proj.weight``), or the whole name. A column at least as wide
    as the longest of them keeps its names apart."""
    tails: dict[str, int] = {}
    distinct = set(names)
    for name in distinct:
        for start in _starts(name):
            tails[name[start:]] = tails.get(name[start:], 0) + 1
    out = {}
    for name in distinct:
        starts = _starts(name)
        form = name
        for i in range(len(starts) - 1, -1, -1):
            tail = name[starts[i] :]
            if tails[tail] == 1:
                form = ELLIPSIS + tail
                break
        out[name] = form if len(form) < len(name) else name
    return out


# -------------------------------------------------------------------- columns


@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    style: Any = ""  # the whole cell's Rich style


def cell_of(value: Any) -> Cell:
    """A str, or a Rich ``Text`` whose style is the whole cell's."""
    plain = getattr(value, "plain", None)
    if plain is not None:
        return Cell(plain, value.style)
    return Cell(str(value))


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    cells: tuple[Cell, ...]
    right: bool = False
    name: bool = False  # dotted names: folded (``fold``), or broken after a dot
    fold: bool = True
    whole: bool = False  # a cell is one word: never wrapped

    @property
    def low(self) -> int:
        """The shortest form: no header word, cell word or (folded) name cut."""
        head = shortest(self.header)
        texts = [c.text for c in self.cells]
        if self.whole:
            return max(head, *map(widest, texts), 0)
        if self.name and self.fold:
            names = [t for t in texts if t and not _prose(t)]
            floor = min(max(map(len, names), default=0), NAME_FLOOR)
            prose = (shortest(t) for t in texts if _prose(t))
            return max(head, floor, *map(len, shortest_names(names).values()), *prose)
        return max(head, *(shortest(t, dots=self.name) for t in texts), 0)

    @property
    def high(self) -> int:
        return max(widest(self.header), *(widest(c.text) for c in self.cells), 1)

    def lines(self, text: str, width: int) -> list[str]:
        if self.whole:
            return text.split("\n")
        if self.name and self.fold and not _prose(text):
            return [fold_name(line, width) for line in text.split("\n")]
        return wrap(text, width, dots=self.name)


def _prose(text: str) -> bool:
    """A cell of words in a column of names (``... 12 more entries``): wrapped."""
    return " " in text


def share(lows: Sequence[int], highs: Sequence[int], room: int) -> list[int] | None:
    """Widths that fit ``room``: each column's widest form if they all fit, else the
    widest columns narrowed to one level (never below a column's shortest form,
    ``lows``), or None where even the shortest forms do not fit."""
    if sum(highs) <= room:
        return list(highs)
    if sum(lows) > room:
        return None

    def total(level: int) -> int:
        return sum(min(h, max(lo, level)) for lo, h in zip(lows, highs))

    level = max(highs)
    while level > 0 and total(level) > room:
        level -= 1
    widths = [min(h, max(lo, level)) for lo, h in zip(lows, highs)]
    spare = room - sum(widths)
    for i, (w, h) in enumerate(zip(widths, highs)):  # what is left, left to right
        if spare and w < h:
            widths[i] += 1
            spare -= 1
    return widths


# -------------------------------------------------------------------- the table


class FitTable:
    """A Rich renderable: the table laid out for the width it is given (see the
    module docstring)."""

    def __init__(
        self,
        title: Any,
        columns: Sequence[Column],
        *,
        caption: Any = None,
        key: Sequence[int] = (0,),
        show_header: bool = True,
        simple: bool = False,
    ):
        self.title, self.caption = title, caption
        self.columns = list(columns)
        self.key = [k for k in key if k < len(self.columns)]
        self.show_header = show_header
        self.simple = simple  # no vertical rules (the plan's grid)
        self.lows = [c.low for c in self.columns]  # each column's shortest form
        self.highs = [c.high for c in self.columns]  # and its widest
        self._drawn: dict[int, int] = {}  # the rules and padding of a part of n columns

    def _fit(self, console: Console, options: ConsoleOptions, indices) -> list[int] | None:
        cols = [self.columns[i] for i in indices]
        room = self._room(console, options, cols)
        return share([self.lows[i] for i in indices], [self.highs[i] for i in indices], room)

    def _table(self, columns: Sequence[Column], widths: Sequence[int] | None):
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(
            box=box.SIMPLE_HEAD if self.simple else box.HEAVY_HEAD,
            pad_edge=not self.simple,
            show_edge=not self.simple,
            header_style="bold",
            show_header=self.show_header,
        )
        for i, c in enumerate(columns):
            w = 1 if widths is None else widths[i]
            head = "\n".join(wrap(c.header, w)) if widths is not None else "x"
            table.add_column(
                Text(head),
                justify="right" if c.right else "left",
                width=w,
                no_wrap=True,
                overflow="crop",
            )
        if widths is None:
            return table
        for r in range(len(columns[0].cells) if columns else 0):
            table.add_row(
                *(
                    Text("\n".join(c.lines(c.cells[r].text, w)), style=c.cells[r].style)
                    for c, w in zip(columns, widths)
                )
            )
        return table

    def _room(self, console: Console, options: ConsoleOptions, columns) -> int:
        """The width left for the cells: the console's less the rules and padding
        (measured once per count of columns: they depend on nothing else)."""
        from rich.measure import Measurement

        n = len(columns)
        if n not in self._drawn:
            probe = self._table(columns, None)
            drawn = Measurement.get(console, options.update_width(10_000), probe).maximum
            self._drawn[n] = drawn - n
        return options.max_width - self._drawn[n]

    def parts(self, console: Console, options: ConsoleOptions) -> list[tuple[list[int], list[int]]]:
        """``(column indices, widths)`` of each part: the whole table where it fits,
        else the fewest parts that fit, each the key and a run of the other columns,
        as even as they go; empty where not even the key and one column fit (stacked)."""
        everything = list(range(len(self.columns)))
        widths = self._fit(console, options, everything)
        if widths is not None:
            return [(everything, widths)]
        rest = [i for i in everything if i not in self.key]
        for count in range(2, len(rest) + 1):
            best: tuple[int, list[tuple[list[int], list[int]]]] | None = None
            for cuts in itertools.combinations(range(1, len(rest)), count - 1):
                bounds = (0, *cuts, len(rest))
                groups = [sorted({*self.key, *rest[a:b]}) for a, b in zip(bounds, bounds[1:])]
                fitted = [self._fit(console, options, g) for g in groups]
                if any(f is None for f in fitted):
                    continue
                widest = max(sum(self.lows[i] for i in g) for g in groups)
                if best is None or widest < best[0]:
                    best = (widest, [(g, f) for g, f in zip(groups, fitted) if f is not None])
            if best is not None:
                return best[1]
        return []

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.text import Text

        yield from _annotation(self.title, options.max_width, "bold")
        parts = self.parts(console, options)
        if not parts:
            yield from self._stacked(options.max_width)
        for n, (indices, widths) in enumerate(parts):
            if n:
                yield Text("(continued)", style="italic")
            yield self._table([self.columns[i] for i in indices], widths)
            if self.simple:  # no rule under it: a blank line ends it
                yield Text("")
        yield from _annotation(self.caption, options.max_width, "")

    def _stacked(self, width: int) -> RenderResult:
        """Each row as lines: its key cells, then ``header value`` per column."""
        from rich.text import Text

        rows = len(self.columns[0].cells) if self.columns else 0
        for r in range(rows):
            head = " ".join(self.columns[k].cells[r].text for k in self.key)
            for line in wrap(head, width, dots=True):
                yield Text(line, style="bold")
            for i, c in enumerate(self.columns):
                if i in self.key:
                    continue
                label = " ".join(c.header.split())
                for line in wrap(f"{label} = {c.cells[r].text}", width - 2, dots=True):
                    yield Text(f"  {line}", style=c.cells[r].style)


def _annotation(value: Any, width: int, style: str) -> RenderResult:
    """A title or a caption, wrapped between words at ``width`` (a dotted name
    wider than that after one of its dots)."""
    from rich.text import Text

    if value is None or value == "":
        return
    plain = getattr(value, "plain", None)
    text, own = (plain, value.style) if plain is not None else (str(value), style)
    width = max(width, 1)
    for line in wrap(text, width, dots=shortest(text) > width):
        yield Text(line, style=own or style)


def fit_table(
    title: Any,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Sequence[int] = (),
    names: Sequence[int] = (),
    whole: Sequence[int] = (),
    fold_names: bool = True,
    key: Sequence[int] = (0,),
    caption: Any = None,
    simple: bool = False,
) -> FitTable:
    """A ``FitTable`` of ``rows`` (str or Rich ``Text`` cells) under ``headers``."""
    columns = [
        Column(
            header=h,
            cells=tuple(cell_of(r[i]) for r in rows),
            right=i in right,
            name=i in names,
            fold=fold_names,
            whole=i in whole,
        )
        for i, h in enumerate(headers)
    ]
    return FitTable(
        title, columns, caption=caption, key=key, show_header=any(headers), simple=simple
    )
