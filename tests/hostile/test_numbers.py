"""Every number a user gives is finite and in range, or the command stops: exit 2 and
one ``error:`` line naming the option, or the file and its field, or where an
allocator setting came from; never ``internal error`` or Python's words.

The command line runs through ``yafsdp_cli.cli.main`` in this process, the console
script's own path (Typer's usage errors become one line there), so that hundreds of
cases share one import of torch.
"""

from __future__ import annotations

import importlib
import math
import re
import signal
import sys

import pytest

from yafsdp_cli.cli import main
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.numbers import MAX_COUNT, checked, problem, shown

from .number_cases import BAD_NUMBERS, FILES, LLAMA, OPTIONS, FileCase, OptionCase

LLAMA_ARGS = ["plan", *LLAMA]


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(argv, env)`` -> (exit code, stderr) of ``yafsdp ARGV``."""
    handler = signal.getsignal(signal.SIGTERM)

    def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "argv", ["yafsdp", *argv])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            signal.signal(signal.SIGTERM, handler)
            for name in env or {}:
                monkeypatch.delenv(name)
        return code, capsys.readouterr().err

    return run


def one_error_line(code: int, err: str) -> str:
    assert code == 2, (code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    line = lines[0]
    assert "internal error" not in line and "Traceback" not in err, line
    assert len(line) < 600, f"{len(line)} characters: the value is not shown in excerpt"
    return line


def option_params():
    for case in OPTIONS:
        for number in BAD_NUMBERS:
            yield pytest.param(case, number, id=f"{case.id}:{number[:6]}")


@pytest.mark.parametrize(("case", "number"), list(option_params()))
def test_a_numeric_option_refuses_what_is_no_number(tmp_path, cli, case: OptionCase, number):
    argv, env = case.argv(tmp_path, number)
    line = one_error_line(*cli(argv, env))
    assert case.option in line, f"{case.option} not named in {line!r}"
    assert list(tmp_path.iterdir()) == [], "something was written"


@pytest.mark.parametrize("case", FILES, ids=[c.id for c in FILES])
def test_a_file_number_is_refused_naming_the_file_and_field(
    tmp_path, cli, monkeypatch, case: FileCase
):
    for dotted, value in case.patch.items():
        module, name = dotted.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, value)
    path = case.build(tmp_path)
    line = one_error_line(*cli(case.argv(path)))
    assert str(path) in line, f"{path} not named in {line!r}"
    assert re.search(case.message, line), f"{case.message!r} not in {line!r}"


def test_the_allocator_setting_names_its_source(cli):
    """The variable may be set far from the failing command: the line says which."""
    code, err = cli(
        [*["plan", "--model", "sample_models.models:llama", "--gpu-memory", "80GiB"]],
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:-1"},
    )
    line = one_error_line(code, err)
    assert line.startswith("error: PYTORCH_CUDA_ALLOC_CONF 'max_split_size_mb:-1': ")
    code, err = cli(
        [
            *["plan", "--model", "sample_models.models:llama", "--gpu-memory", "80GiB"],
            "--alloc-conf",
            "max_split_size_mb:-1",
        ],
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert one_error_line(code, err).startswith("error: --alloc-conf 'max_split_size_mb:-1': ")


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, 1e400, -1, 10**400, 0.5, "3", True, None, 2**21],
)
def test_checked_refuses_every_value_out_of_range(value):
    with pytest.raises(YafsdpError, match=r"^--x must be .*, got "):
        checked(value, "--x", 1, MAX_COUNT, whole=True)


def test_checked_passes_what_is_in_range():
    assert checked(8, "--x", 1, MAX_COUNT, whole=True) == 8
    assert checked(8.0, "--x", 1, MAX_COUNT, whole=True) == 8
    assert checked(0.5, "--x", 0, 1, above=True) == 0.5
    assert problem(1, 0, 1, above=True) is None


def test_shown_bounds_what_a_message_repeats():
    assert shown(10**5000) == "a number of about 5001 digits"  # Python refuses str() here
    assert len(shown("x" * 10_000)) == 40
    assert shown("a\x1b[31mb") == "a\\x1b[31mb"


@pytest.mark.parametrize("rate", ["1e-300GB/s", "0.0001MB/s", "2000TB/s", "1e400GB/s"])
def test_a_bandwidth_is_one_a_time_can_be_divided_by(cli, rate):
    """A step's time is bytes over a rate: 1e-300 bytes/s would make it infinite,
    which --json cannot print."""
    line = one_error_line(*cli([*LLAMA_ARGS, "--gpu", "h100-sxm", "--network", rate, "--json"]))
    assert "--network" in line and "a bandwidth is from 1 kB/s to 1 PB/s" in line, line
