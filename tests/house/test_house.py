"""The house keeps its shape: rooms import one way, and no module imports itself back.

Every import in the package is read from the source (``ast``), module level and
inside functions alike: a lazy import that closes a cycle is still a cycle.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "yafsdp_cli"

# Lower ranks are imported by higher ones, never the other way round. Rooms that share
# a rank do not import each other.
RANKS = {
    "errors": 0,
    "lazy": 0,
    "gpu_table": 0,
    "fileio": 1,
    "numbers": 1,
    "mesh": 1,
    "engine": 2,
    "options": 3,
    "sources": 3,
    "schemes": 3,
    "memory": 4,
    "inspection": 5,
    "verify": 5,
    "profiling": 5,
    "timing": 6,
    "planning": 7,
    "checkpoint": 5,
    "gate": 8,
    "report": 9,
    "cli": 10,
}
UI_LIBRARIES = ("rich", "typer")
UI_ROOMS = ("report", "cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules that ``name`` imports (submodules named by ``from X import y``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PKG.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PKG.name:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found.update(subs or {target})
    found.discard(name)
    return found


def external_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def room(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package's public facade


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {n: imports_of(n, p, known) for n, p in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_every_room_is_ranked():
    rooms = {room(n) for n in modules()} - {None, "schemas"}
    assert rooms <= set(RANKS), f"rooms without a rank in this test: {rooms - set(RANKS)}"


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(modules()))
def test_imports_flow_one_way(name):
    here = room(name)
    if here is None:
        return  # the facade re-exports the engine's public names
    wrong = []
    for target in sorted(graph()[name]):
        there = room(target)
        if there is None and here != "cli":  # the CLI may read __version__
            wrong.append(f"{target} (the package facade; import the room instead)")
        elif there is not None and there != here and RANKS[there] >= RANKS[here]:
            wrong.append(f"{target} ({there}, rank {RANKS[there]} >= {here}, rank {RANKS[here]})")
    assert not wrong, f"{name} imports against the house order: {wrong}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_only_report_and_cli_import_rich_and_typer(name):
    if room(name) in UI_ROOMS:
        return
    used = external_imports(modules()[name]) & set(UI_LIBRARIES)
    assert not used, f"{name} imports {sorted(used)}; rendering belongs to report/ and cli/"


def test_no_command_module_imports_another():
    """What two commands share lives in ``cli.flags`` or ``cli.command_kit`` (or the
    library), never in one command's module."""
    edges = graph()
    commands = {n for n in edges if n.startswith(f"{PKG.name}.cli.") and n.endswith("_cmd")}
    assert len(commands) >= 6, commands
    wrong = {n: sorted(edges[n] & commands) for n in sorted(commands) if edges[n] & commands}
    assert not wrong, f"command modules importing other command modules: {wrong}"


def test_every_room_says_what_it_owns():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 15, f"{init.parent.name}/__init__.py needs its docstring"


def stems(paths) -> dict[str, list[str]]:
    """Each module's last name (a package's is its folder's) and where it appears."""
    seen: dict[str, list[str]] = {}
    for path in paths:
        rel = path.relative_to(PKG)
        stem = rel.parent.name if path.name == "__init__.py" else path.stem
        if stem:  # the package's own __init__
            seen.setdefault(stem, []).append(str(rel))
    return seen


def test_no_two_modules_share_a_name():
    """A module name says what it does and appears once: ``from .check import`` must
    never leave the reader asking which ``check``."""
    shared = {s: where for s, where in stems(sorted(PKG.rglob("*.py"))).items() if len(where) > 1}
    assert not shared, f"module names used more than once: {shared}"


def test_the_name_check_sees_a_shared_name():
    paths = [PKG / "gate" / "check.py", PKG / "report" / "check.py", PKG / "engine" / "__init__.py"]
    assert stems(paths) == {
        "check": ["gate/check.py", "report/check.py"],
        "engine": ["engine/__init__.py"],
    }
    clash = [PKG / "engine" / "__init__.py", PKG / "checkpoint" / "engine.py"]
    assert stems(clash) == {"engine": ["engine/__init__.py", "checkpoint/engine.py"]}


def stdlib_imported() -> set[str]:
    """Standard-library modules the package imports (the top name of each import)."""
    import sys

    found: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return found & set(sys.stdlib_module_names)


def test_no_module_shadows_a_standard_module_the_package_imports():
    """``from . import copy`` beside ``import copy`` leaves the reader asking which: a
    module of ours never takes the name of a standard module the package uses."""
    imported = stdlib_imported()
    assert {"copy", "inspect", "html", "json", "os"} <= imported  # the check sees them
    shadows = {s: where for s, where in stems(sorted(PKG.rglob("*.py"))).items() if s in imported}
    assert not shadows, f"modules named as standard modules the package imports: {shadows}"


def test_every_reader_answers_the_whole_reader_protocol():
    """``convert`` calls a reader's capabilities directly: each reader class has every
    method the protocol names, and nothing in the package probes a reader by name."""
    from yafsdp_cli.sources.dcp_folder import DcpReader
    from yafsdp_cli.sources.hf_readers import PretrainedReader, RenamedReader
    from yafsdp_cli.sources.loaded import TensorReader
    from yafsdp_cli.sources.safetensors_file import SafetensorsReader
    from yafsdp_cli.sources.torch_file import TensorDictReader

    wanted = {n for n, v in vars(TensorReader).items() if callable(v) and not n.startswith("_")}
    assert {"file_ranges", "check_copied", "files", "iter_bytes"} <= wanted
    readers = (SafetensorsReader, DcpReader, TensorDictReader, RenamedReader, PretrainedReader)
    for cls in readers:
        missing = sorted(n for n in wanted if not callable(getattr(cls, n, None)))
        assert not missing, f"{cls.__name__} lacks {missing}"
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        shadowed = [
            t.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self" and t.attr in wanted
        ]
        assert not shadowed, f"{cls.__name__} sets {shadowed} on an instance, over the method"
    probes = [
        f"{path.relative_to(PKG)}:{node.lineno}"
        for path in sorted(PKG.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("getattr", "hasattr")
        and len(node.args) >= 2
        and "reader" in ast.unparse(node.args[0]).split(".")[-1]
        and isinstance(node.args[1], ast.Constant)
    ]
    assert not probes, f"a reader probed by getattr/hasattr: {probes}"
