"""Every bad input of the corpus through every command that reads it: exit 2, one
line on stderr naming the file and what is wrong, no traceback, nothing left behind
(hidden temporaries included) and every input byte for byte as it was."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

from .common import Case, snapshot
from .dcp_cases import DCP
from .flat_cases import FLAT
from .link_cases import LINKS
from .output_cases import OUTPUTS, RO, source_for
from .st_cases import HF, INDEXES, SAFETENSORS
from .torch_cases import MARKER, TORCH

runner = CliRunner()
CORPUS: list[Case] = SAFETENSORS + INDEXES + HF + TORCH + FLAT + OUTPUTS + LINKS + DCP


def argv(command: str, src: Path, out: Path, folder: Path) -> list[str]:
    return {
        "inspect": ["inspect", src],
        "convert": ["convert", src, "-o", out],
        "verify": ["verify", src],
        "profile": ["profile", src],
        "check": ["check", src, "--baseline", folder / "baseline.json", "--update"],
        "restore": ["restore", src, "-o", out],
        "reshard": ["reshard", src, "-n", "4", "-o", out],
        "plan": ["plan", src, "--gpu-memory", "80GiB"],
    }[command]


@contextlib.contextmanager
def read_only_folder(path: Path):
    """``path`` as a folder nobody may write: a read-only mount for root, else 0o555."""
    path.mkdir()
    if os.geteuid():
        path.chmod(0o555)
        yield
        path.chmod(0o755)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)])
    if done.returncode:
        pytest.skip("root, but cannot mount a read-only tmpfs here")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def params():
    for case in CORPUS:
        marks = [pytest.mark.hf] if case.needs == "hf" else []
        for command in case.commands:
            yield pytest.param(case, command, id=f"{case.id}-{command}", marks=marks)


@pytest.mark.parametrize(("case", "command"), list(params()))
def test_bad_input_is_refused_cleanly(tmp_path, case: Case, command: str):
    if case.needs == "hf":
        pytest.importorskip("transformers")
    folder = tmp_path / "case"
    folder.mkdir()
    src = case.build(folder)
    if case.out is not None:
        src = source_for(command, folder)
    with read_only_folder(folder / RO) if case.needs == "ro" else contextlib.nullcontext():
        out = case.out(folder, src) if case.out else folder / "o.safetensors"
        before = snapshot(folder)
        args = [str(a) for a in argv(command, src, out, folder)] + (["-f"] if case.force else [])
        result = runner.invoke(app, args)
        after = snapshot(folder)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    line = lines[0]
    assert "Traceback" not in result.output and "internal error" not in line, line
    assert re.search(case.message, line), f"{case.message!r} not in {line!r}"
    named = out if case.out else src
    assert str(named) in line or named.name in line, f"{named} not named in {line!r}"
    assert after == before, "the folder changed: " + ", ".join(
        sorted(set(after) ^ set(before) | {k for k in before if after.get(k) != before[k]})
    )
    assert not (folder / MARKER).exists(), "the pickle ran code"
