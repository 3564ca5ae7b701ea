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
