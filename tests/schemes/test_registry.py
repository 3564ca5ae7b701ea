"""The one registry of schemes: its order, lookups and parsing, the JSON schemas that
spell its keys, and that scheme names are strings only in ``yafsdp_cli/schemes`` and
at the edges (a scheme compared by a string elsewhere fails here)."""

from __future__ import annotations

import ast
import json
from importlib import resources
from pathlib import Path

import pytest

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.schemes import (
    DDP,
    FLAT,
    FSDP2,
    NAMES,
    SCHEMES,
    ZERO1,
    ZERO2,
    ZERO3,
    by_name,
    check_names,
    parse,
    timed,
)

PKG = Path(__file__).resolve().parents[2] / "yafsdp_cli"

# (file under yafsdp_cli, string): where a scheme's spelling is something else, or the
# command line's edge. Everything else spells schemes through their objects.
ALLOWED = {
    # the --align names (engine.layout's alignments) and their defaults
    ("engine/layout.py", "yafsdp"): "alignment",
    ("engine/layout.py", "fsdp"): "alignment",
    # a checkpoint file's kind (yafsdp.format)
    ("checkpoint/format.py", "flat"): "file kind",
    # the program's name
    ("cli/root.py", "yafsdp"): "program",
    ("cli/__init__.py", "yafsdp"): "program",
    # --scheme's default, on the command line
    ("cli/plan_cmd.py", "flat"): "flag default",
}


def spellings() -> set[str]:
    keys = {s.inspect_key for s in SCHEMES} | {s.timing_key for s in SCHEMES}
    return set(NAMES) | (keys - {None})


def _align_defaults(tree: ast.AST) -> set[int]:
    """ids of the constants that are the default of an ``align`` parameter or field."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            for arg, default in zip(args[len(args) - len(node.defaults) :], node.defaults):
                if arg.arg == "align":
                    out.add(id(default))
            for arg, default in zip(node.kwonlyargs, node.kw_defaults):
                if arg.arg == "align" and default is not None:
                    out.add(id(default))
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "align"
            and node.value is not None
        ):
            out.add(id(node.value))
    return out


def scheme_strings(source: str, where: str, words: set[str]) -> list[str]:
    """``where:line 'word'`` for each string constant in ``source`` spelling a scheme,
    beyond ``ALLOWED`` and the ``align`` defaults."""
    tree = ast.parse(source)
    skip = _align_defaults(tree)
    return [
        f"{where}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in words
        and id(node) not in skip
        and (where, node.value) not in ALLOWED
    ]


def test_scheme_names_are_strings_only_in_the_registry_and_at_the_edges():
    words = spellings()
    found = []
    for path in sorted(PKG.rglob("*.py")):
        where = path.relative_to(PKG).as_posix()
        if where.startswith("schemes/"):
            continue
        found += scheme_strings(path.read_text(), where, words)
    assert not found, f"compare schemes as objects (yafsdp_cli.schemes): {found}"


def test_the_check_finds_a_scheme_compared_by_its_name():
    words = spellings()
    source = 'def f(s, align="yafsdp"):\n    return s.scheme == "zero2" or s == "fsdp"\n'
    assert scheme_strings(source, "planning/x.py", words) == [
        "planning/x.py:2 'zero2'",
        "planning/x.py:2 'fsdp'",
    ]
    assert scheme_strings('KIND = "flat"\n', "checkpoint/format.py", words) == []
    assert scheme_strings('KIND = "flat"\n', "checkpoint/other.py", words) != []


def test_one_registry_in_one_order():
    assert SCHEMES == (FLAT, FSDP2, ZERO1, ZERO2, ZERO3, DDP)
    assert NAMES == ("flat", "fsdp2", "zero1", "zero2", "zero3", "ddp")
    assert [by_name(n) for n in NAMES] == list(SCHEMES)
    assert timed() == (FLAT, FSDP2, DDP)
    assert len({s.inspect_key for s in SCHEMES} - {None}) == 5  # inspect's five columns
    with pytest.raises(YafsdpError, match="unknown scheme 'zero4'"):
        by_name("zero4")


def test_parsing_a_comma_list_or_all():
    assert parse("all") == SCHEMES
    assert parse("zero3, FLAT") == (FLAT, ZERO3)
    assert parse(("ddp", "fsdp2")) == (FLAT, FSDP2, DDP)  # flat always among them
    assert check_names("zero2") == ("flat", "zero2")
    with pytest.raises(YafsdpError, match=r"--scheme 'zero4,x': unknown scheme zero4, x; give"):
        parse("zero4,x")
    with pytest.raises(YafsdpError, match=r"unknown scheme \(none\); give a comma list of flat,"):
        parse(" , ")


def _schema(name: str) -> dict:
    return json.loads(resources.files("yafsdp_cli").joinpath(f"schemas/{name}").read_text())


def test_the_json_schemas_spell_the_registrys_keys():
    plan = _schema("plan.schema.json")
    enums = []

    def walk(node):
        if isinstance(node, dict):
            if "scheme" in node.get("properties", {}):
                enums.append(node["properties"]["scheme"].get("enum"))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(plan)
    assert list(NAMES) in enums  # plan --scheme rows
    assert [s.timing_key for s in timed()] in enums  # timed rows
    inspect = _schema("inspect.schema.json")
    walk(inspect)
    inspect_keys = {s.inspect_key for s in SCHEMES} - {None}
    assert any(e and set(e) == inspect_keys for e in enums)
