"""The console script itself: usage errors are one line on stderr with exit 2."""

from __future__ import annotations

import ast
import json
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


def test_restore_imports_only_the_modules_it_runs(tmp_path):
    """The library's packages import a module when one of its names is first used:
    restoring a checkpoint without optimizer state loads no source reader, none of
    convert's planning and no optimizer-state parser."""
    flat, back = tmp_path / "f.safetensors", tmp_path / "b.safetensors"
    assert run("convert", "sample_models/mlp.safetensors", "-o", str(flat)).returncode == 0
    code = (
        "import sys\n"
        "from yafsdp_cli.cli import main\n"
        f"sys.argv = ['yafsdp', 'restore', {str(flat)!r}, '-o', {str(back)!r}, '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(sorted(m for m in sys.modules if m.startswith('yafsdp_cli.')), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    loaded = set(ast.literal_eval(result.stderr.strip().splitlines()[-1]))
    assert "yafsdp_cli.checkpoint.restore" in loaded and back.is_file()
    unused = {
        "yafsdp_cli.checkpoint.convert",
        "yafsdp_cli.checkpoint.optim_state",
        "yafsdp_cli.engine.plan",
        "yafsdp_cli.engine.filters",
        "yafsdp_cli.sources.load",
        "yafsdp_cli.sources.torch_pickle",
    }
    assert not loaded & unused, sorted(loaded & unused)


# A module-level object whose __del__ reports the interpreter's teardown, and an
# atexit handler; then the console script.
_CONSOLE = """
import atexit, sys
class Teardown:
    def __del__(self):
        sys.stderr.write("teardown ran\\n")
keep = Teardown()
atexit.register(lambda: sys.stderr.write("atexit ran\\n"))
if sys.argv[1] == "torch":
    import torch
sys.argv = ["yafsdp", *sys.argv[2:]]
from yafsdp_cli.cli import console
console()
"""


@pytest.mark.parametrize("torch", [False, True])
def test_the_console_script_skips_only_the_teardown(torch):
    """Without torch the script flushes its output, runs atexit handlers and leaves
    the modules as they are; with torch loaded it exits the ordinary way."""
    argv = ["torch" if torch else "-", "inspect", "sample_models/mlp.safetensors", "--json"]
    ok = subprocess.run([sys.executable, "-c", _CONSOLE, *argv], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["schema"] == "yafsdp.inspect/1"  # all of it, flushed
    assert "atexit ran" in ok.stderr
    assert ("teardown ran" in ok.stderr) == torch
    bad = [argv[0], "inspect", "no/such/file.safetensors"]
    failed = subprocess.run([sys.executable, "-c", _CONSOLE, *bad], capture_output=True, text=True)
    assert failed.returncode == 2 and "no such file or folder" in failed.stderr
    assert "atexit ran" in failed.stderr
