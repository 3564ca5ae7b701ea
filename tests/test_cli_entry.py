"""The console script itself: usage errors are one line on stderr with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from yafsdp_cli.cli import main; sys.argv[0] = 'yafsdp'; main()"
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, *args], capture_output=True, text=True
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["inspect", "sample_models/mlp.safetensors", "-n", "0"],
            "Invalid value for '--world-size'",
        ),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["inspect", "sample_models/mlp.safetensors", "--bogus"], "No such option: --bogus"),
        (["convert", "sample_models/mlp.safetensors"], "Missing option '--output'"),
        (["inspect", "no/such/file.safetensors"], "no such file or folder"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, message):
    result = run(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert result.stdout == ""


def test_version_and_success_exit_0():
    assert run("--version").stdout.startswith("yafsdp ")
    result = run("inspect", "sample_models/mlp.safetensors", "--json")
    assert result.returncode == 0 and result.stdout.lstrip().startswith("{")


def test_every_command_is_mapped_to_the_module_that_registers_it():
    """``main`` imports only the module of the command it runs: a command missing
    from ``COMMAND_MODULES`` would not be found, one mapped wrongly not registered."""
    from yafsdp_cli.cli import COMMAND_MODULES, app

    registered = {c.name: c.callback.__module__ for c in app.registered_commands}
    assert registered == {k: f"yafsdp_cli.cli.{m}" for k, m in COMMAND_MODULES.items()}


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["convert", "x", "-o", "y"], "convert"),
        (["--debug", "restore", "x"], "restore"),
        (["--help", "convert"], None),  # the root's help lists every command
        (["--version"], None),
        (["frobnicate"], None),  # unknown: every command, for Typer's suggestions
        ([], None),
    ],
)
def test_the_command_to_load_is_read_from_argv(argv, command):
    from yafsdp_cli.cli import command_of

    assert command_of(argv) == command


def test_a_json_copy_command_imports_neither_rich_nor_other_commands(tmp_path):
    out = tmp_path / "f.safetensors"
    code = (
        "import sys\n"
        "from yafsdp_cli.cli import main\n"
        f"sys.argv = ['yafsdp', 'convert', 'sample_models/mlp.safetensors', '-o', {str(out)!r},"
        " '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'pydantic')\n"
        "    or m.startswith('yafsdp_cli.cli.') and m.endswith('_cmd'))\n"
        "print(loaded, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "['yafsdp_cli.cli.convert_cmd']"
    assert out.is_file()


def test_the_root_help_still_lists_every_command():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for name in ("check", "convert", "restore", "reshard", "inspect", "verify", "plan", "profile"):
        assert name in result.stdout
