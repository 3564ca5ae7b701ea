"""The plan's views show each row's ``Fit`` and decide nothing: no view compares or
subtracts the memory figures a verdict rests on, and a verdict the figures contradict
is shown as given."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest
from helpers import options

from yafsdp_cli.memory.headroom import FITS, OVER, TIGHT, Fit
from yafsdp_cli.report import plan_view
from yafsdp_cli.report.formatting import human_bytes

REPORT = Path(plan_view.__file__).parent

# names (split at "_") of the figures a verdict rests on: what the GPU must have, its
# memory, what is left, the margin, and their ratio
FIGURES = {"gpu", "free", "needed", "headroom", "margin", "capacity", "limit", "ratio", "available"}
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
ARITHMETIC = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)
# what a view may take from memory.headroom: the Fit and the names of its verdicts
SHOWN = {"Fit", "FITS", "TIGHT", "OVER"}


def _names(node: ast.AST):
    """Every name in ``node``: variables, attributes, and string keys read
    (``cell["peak_bytes"]``, ``cell.get("tight")``)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
            yield str(n.slice.value)
        elif getattr(getattr(n, "func", None), "attr", None) == "get" and n.args:
            key = n.args[0]
            yield str(key.value) if isinstance(key, ast.Constant) else ""


def decisions(source: str) -> list[str]:
    """The places in ``source`` that decide a verdict: an ordering comparison or a
    difference or ratio of verdict figures, or a verdict function of
    ``memory.headroom`` imported."""
    found = []
    for node in ast.walk(ast.parse(source)):
        compares = isinstance(node, ast.Compare) and any(isinstance(o, ORDERING) for o in node.ops)
        computes = isinstance(node, ast.BinOp) and isinstance(node.op, ARITHMETIC)
        names = _names(node) if compares or computes else ()
        if any(FIGURES & set(name.lower().split("_")) for name in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("headroom"):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name not in SHOWN]
    return found


def test_the_rule_sees_a_view_that_decides():
    # how the views once decided, each a decision
    cases = [
        "fits = 'fits' if ratio <= 0.8 else 'over'",
        "ratio = peak / limit",
        "free = report.gpu_memory_bytes - needed",
        "tight = needed > gpu - report.margin_bytes",
        "tight = cell['needed_bytes'] >= cell.get('gpu_memory_bytes')",
        "from ..memory.headroom import keeps_margin",
    ]
    for source in cases:
        assert decisions(source), source
    # what a view does with a Fit, and a chart's own arithmetic
    fine = [
        "text = f'{human_bytes(shown.free)} free'",
        "from ..memory.headroom import FITS, OVER, TIGHT, Fit",
        "width = span * share / sum(shares)",
        "if row.fits_with is not None: pass",
        "x = peak[0] > W * 0.7",
    ]
    for source in fine:
        assert not decisions(source), source


@pytest.mark.parametrize("path", sorted(REPORT.glob("*.py")), ids=lambda p: p.name)
def test_no_view_decides_a_verdict(path):
    found = decisions(path.read_text())
    assert not found, f"report/{path.name} decides what a Fit says: {found}"


@pytest.fixture(scope="module")
def planned():
    from yafsdp_cli.planning import PlanOptions, plan_model
    from yafsdp_cli.sources import load_source

    loaded = load_source(None, model="sample_models.models:gpt")
    opts = options(
        PlanOptions,
        gpu_memory=80 * 2**30,
        world_sizes=(1, 2),
        micro_batches=(1, 2),
        checkpointing=("none",),
        seq_len=16,
        jobs=1,
    )
    return plan_model(loaded, opts)


def test_every_row_carries_the_fit_its_fields_give(planned):
    for r in [*planned.rows, planned.best]:
        assert r.fit.needed == r.needed_bytes and r.fit.fits == r.fits
        assert r.fit.free == planned.gpu_memory_bytes - r.needed_bytes
    doc = json.loads(plan_view.to_json(planned))
    assert all("fit" not in r for r in doc["rows"])  # the document gives its fields alone


def test_the_views_show_the_fit_even_where_its_figures_say_otherwise(planned):
    """Each row of a roomy plan given a verdict its figures contradict: the views
    show the verdict, and the free bytes the Fit gives."""
    given = [OVER, TIGHT, FITS, OVER]
    rows = []
    for r, verdict in zip(planned.rows, given):
        free = 12_345 if verdict == FITS else -1 if verdict == TIGHT else 10 * 2**30
        rows.append(dataclasses.replace(r, fit=Fit(r.needed_bytes, free, verdict)))
    best = rows[2]
    report = dataclasses.replace(planned, rows=tuple(rows), best=best, advice=None)

    words = [plan_view.grid(report, "none")[1][i][1:] for i in range(2)]
    assert [w.split()[-1] for row in words for w in row] == ["OOM", "fits", "fits", "OOM"]
    cells = plan_view.cells(report)[1]
    assert [c[-1] for c in cells] == ["OOM", "fits", "fits", "OOM"]
    page = plan_view.plan_page(report)
    levels = re.findall(r'<td class="cell (\w+)"', page)
    assert levels == ["over", "tight", "fits", "over"]
    assert f"({human_bytes(12_345)} free)" in plan_view.answer(report)[1]
    assert f"{human_bytes(12_345)} free of" in "\n".join(plan_view.summary_lines(report))
    markdown = plan_view.to_markdown(report)
    assert f"{human_bytes(rows[0].needed_bytes)} OOM" in markdown
