"""``--help``: the commands in the README's order, every command's help within 80
columns with room for its descriptions."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from typer.testing import CliRunner

from yafsdp_cli.cli import COMMAND_MODULES, app

runner = CliRunner()


def readme_order() -> list[str]:
    return re.findall(r"^\| `yafsdp (\w+)", (ROOT / "README.md").read_text(), flags=re.M)


def test_the_root_help_lists_commands_in_the_readmes_order():
    result = runner.invoke(app, ["--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    listed = re.findall(r"^  (\w+)\s{2,}\S", result.output.split("Commands:")[1], flags=re.M)
    assert listed == readme_order() == list(COMMAND_MODULES)


@pytest.mark.parametrize("command", list(COMMAND_MODULES))
def test_each_commands_help_fits_80_columns(command):
    result = runner.invoke(app, [command, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80
    # descriptions start by column 34, so each has at least 46 columns to itself
    starts = [len(m.group(1)) for m in re.finditer(r"^(  -[^\n]*?[ ]{2,})\S", result.output, re.M)]
    assert starts and max(starts) <= 34, starts
    assert len(lines) <= 100  # long explanations live in docs/, not here
