"""What a terminal reader sees go wrong in a narrow table, found in printed text:
a column of no width, a table line wider than the terminal, and a word broken across
lines or cut inside a cell (a word printed narrow that the same output, printed wide,
never holds: ``non-reentr``, ``float3``, ``st`` for ``step``, ``…yernorm``)."""

from __future__ import annotations

import re

BOX_LINE = re.compile(r"[│┃┏┓┗┛┡┩┌┐└┘━─]")
# a column of no width: two junctions of a rule side by side
ZERO_WIDTH = re.compile(r"[┏┳┌┬┡╇├┼└┴┗┻][┳┬╇┼┴┻┓┐┩┤┘┛]")
# words: split at spaces, rules, an ellipsis, before a slice and at a dotted name's dot
# (a name folds and wraps there), never at a decimal point
SPLIT = re.compile(r"[\s│┃┏┓┗┛┡┩┌┐└┘━─┳┻╇┬┴┼├┤…]+|(?<=.)(?=\[)|(?<=[^\W\d]|\*)\.|\.(?=[^\W\d]|\*)")

NUMBER = re.compile(r"^\d[\d,]*(\.\d+)?$")


def words(text: str) -> set[str]:
    found = set()
    for w in SPLIT.split(text):
        parts = re.split(r"(?<=/)", w)  # a path may break after a slash
        found.update(p for p in parts if any(ch.isalnum() for ch in p))
    return found


def layout_problems(narrow: str, wide: str, width: int) -> list[str]:
    """What is wrong with ``narrow`` (printed at ``width`` columns) beside ``wide``
    (the same printed where nothing needs to wrap)."""
    found = []
    for line in narrow.splitlines():
        if BOX_LINE.search(line) and len(line) > width:
            found.append(f"{width}: a table line {len(line)} wide: {line}")
        if ZERO_WIDTH.search(line):
            found.append(f"{width}: a column of no width: {line}")
    # a whole number may differ between two runs (a process's memory, what is free)
    broken = sorted(w for w in words(narrow) - words(wide) - {"(continued)"} if not NUMBER.match(w))
    if broken:
        found.append(f"{width}: words broken or cut: {broken}\n{narrow}")
    return found
