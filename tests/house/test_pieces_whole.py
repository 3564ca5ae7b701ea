"""Options travel whole: no public library function takes two or more fields of one
options piece (``LayoutOptions``, ``StepOptions``, ``MemoryOptions``) as loose
parameters; it takes the piece (or, below the options room, a ``Protocol`` naming
the fields it reads: ``engine.plan.LayoutChoice``, ``engine.inputs.BatchChoice``).

Read from the source (``ast``), so a new function that unpacks a piece fails here.
The command line (``cli/``) is the edge where flags arrive one by one, and
``options/`` is where the pieces parse them; private helpers (``_name``) are a
function's own business.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from yafsdp_cli.options import LayoutOptions, MemoryOptions, StepOptions

PKG = Path(__file__).resolve().parents[2] / "yafsdp_cli"
PIECES = {
    c.__name__: {f.name for f in dataclasses.fields(c)}
    for c in (LayoutOptions, StepOptions, MemoryOptions)
}
EDGES = ("cli", "options")
# (module, function): why its parameters share names with a piece's fields
ALLOWED = {
    ("memory/headroom.py", "fit"): "byte figures (the held bytes beside the allocator, the "
    "margin in bytes), not the options' text or tuples",
    ("sources/adapted.py", "adapted"): "the adapter built from parsed values (a peft "
    "LoraConfig, the packing kind); adapt(loaded, step) is the entry that takes the piece",
}


def loose(source: str) -> list[tuple[str, int, str, list[str]]]:
    """``(function, line, piece, fields)`` for each public function of ``source`` that
    takes more than one field of a piece."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_"):
            continue
        a = node.args
        names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
        for piece, fields in PIECES.items():
            hit = sorted(names & fields)
            if len(hit) > 1:
                found.append((node.name, node.lineno, piece, hit))
    return found


def test_no_library_function_takes_a_piece_field_by_field():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.split("/")[0] in EDGES:
            continue
        for name, line, piece, hit in loose(path.read_text()):
            if (rel, name) not in ALLOWED:
                wrong.append(f"{rel}:{line} {name}({', '.join(hit)}): take the {piece} whole")
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_function_that_unpacks_a_piece():
    source = (
        "def plan(spec, filters, excludes): ...\n"
        "def _private(world_size, align): ...\n"
        "def fine(spec, layout, seed): ...\n"
    )
    assert loose(source) == [("plan", 1, "LayoutOptions", ["excludes", "filters"])]


def test_every_allowance_still_names_a_function_that_needs_it():
    for (rel, name), why in ALLOWED.items():
        hits = [h for h in loose((PKG / rel).read_text()) if h[0] == name]
        assert hits, f"{rel}: {name} no longer takes piece fields; drop its allowance ({why})"
