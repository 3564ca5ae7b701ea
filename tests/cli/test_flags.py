"""The commands' parameters and the options model's pieces do not drift apart.

Each command builds each piece with that piece's builder in ``cli/flags.py``, naming
every value by the piece's field. Read from the commands' source (``ast``): every
keyword a command gives a builder is a field of that piece and a parameter of the
command (a piece field a command offers has a flag), and every parameter of a
command reaches a builder, the command's options or its request, or is one of the
command line's own (SOURCE, --json, ...).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

# ``app`` first: it registers every command in the README's order (``--help`` lists
# them so) before the modules below are imported one by one
from yafsdp_cli.cli import (
    app,  # noqa: F401
    check_cmd,
    convert_cmd,
    flags,
    inspect_cmd,
    plan_cmd,
    profile_cmd,
    verify_cmd,
)
from yafsdp_cli.options import LayoutOptions, MemoryOptions, StepOptions

PIECES = {"layout": LayoutOptions, "step": StepOptions, "memory": MemoryOptions}
BUILDERS = {
    **{f"{name}_given": name for name in PIECES},
    **{f"{name}_from": name for name in PIECES},
}
# what a command passes its values to besides the builders
CONSUMERS = {
    "InspectOptions",
    "ProfileOptions",
    "VerifyOptions",
    "PlanOptions",
    "CheckRequest",
    "memory_sizes",  # plan's sizes, parsed in one place
    "_held_and_margin",  # plan's --margin, a share of the GPU once it is known
    "parse_ints",
    "parse_rate",
    "parse_count",
    "check_schemes",
    "convert_checkpoint",  # convert's own: where, how many files, read back, overwrite
}
# the command line's own: what to load, how to print, where to write
OWN = {
    "source",
    "model",
    "trust_pickle",
    "json_out",
    "fmt",
    "html",
    "explain",
    "show_all",
    "markdown",
    "baseline",
}
COMMANDS = {
    "inspect": inspect_cmd.inspect_command,
    "profile": profile_cmd.profile_command,
    "verify": verify_cmd.verify_command,
    "plan": plan_cmd.plan_command,
    "check": check_cmd.check_command,
    "convert": convert_cmd.convert_command,
}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def drift(source: str, params: set[str]) -> list[str]:
    """What is wrong with a command whose function is ``source`` and whose Typer
    parameters are ``params``."""
    tree = ast.parse(textwrap.dedent(source))
    wrong, consumed = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _name(node.func)
        if called in BUILDERS:
            piece = PIECES[BUILDERS[called]]
            fields = {f.name for f in dataclasses.fields(piece)}
            for kw in node.keywords:
                if kw.arg not in fields:
                    wrong.append(f"{called}({kw.arg}=...): {piece.__name__} has no such field")
                elif kw.arg not in params:
                    wrong.append(f"{called}({kw.arg}=...): the command has no --{kw.arg} flag")
        if called in BUILDERS or called in CONSUMERS:
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                consumed |= {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
    wrong += [f"parameter {p!r} reaches no builder" for p in sorted(params - consumed - OWN)]
    return wrong


def test_each_builder_takes_exactly_its_pieces_fields():
    for name, piece in PIECES.items():
        takes = set(inspect.signature(getattr(flags, f"{name}_given")).parameters)
        assert takes == {f.name for f in dataclasses.fields(piece)}, name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_parameter_of_a_command_reaches_its_options(name):
    command = COMMANDS[name]
    params = set(inspect.signature(command).parameters)
    assert drift(inspect.getsource(command), params) == []


def test_the_check_finds_a_misspelt_a_missing_and_an_unused_option():
    source = """
    def command(filters, world_size, seq_len, align):
        layout_from(base, filter=filters, world_size=world_size)
        step_from(base, batch=seq_len)
    """
    assert drift(source, {"filters", "world_size", "seq_len", "align"}) == [
        "layout_from(filter=...): LayoutOptions has no such field",
        "step_from(batch=...): the command has no --batch flag",
        "parameter 'align' reaches no builder",
    ]


def test_a_misspelt_name_is_a_type_error_at_the_call():
    with pytest.raises(TypeError):
        flags.layout_from(LayoutOptions(), filter=["linear"])
    assert flags.layout_from(LayoutOptions(), filters=["linear"], units=None) == LayoutOptions(
        filters=("linear",)
    )
    assert flags.step_given(input_shape="2,3", freeze=[]) == {"input_shape": (2, 3)}
