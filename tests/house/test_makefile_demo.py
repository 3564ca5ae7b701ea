"""``make demo``, the README's first command, runs as written: every line of its
recipe, in order, in a fresh folder holding a copy of ``sample_models/`` (the
install step is this suite's own environment, so it is not repeated), and reads
cleanly on an 80-column terminal."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from tests.terminal_text import layout_problems


def demo_recipe(makefile: str) -> list[str]:
    """The demo target's command lines, with ``$(BIN)`` and ``$(DEMO)`` filled in."""
    variables = dict(re.findall(r"^(\w+)\s*:=\s*(.+)$", makefile, flags=re.M))
    body = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert body, "the Makefile has no demo target"
    lines = [ln.strip() for ln in body.group(1).splitlines()]
    bindir = str(Path(sys.executable).parent)
    out = []
    for line in lines:
        line = line.replace("$(BIN)", bindir).replace("$(DEMO)", variables["DEMO"])
        assert "$(" not in line, f"unknown make variable in {line!r}"
        out.append(line)
    return out


def test_the_recipe_reader():
    text = "DEMO := out\ndemo: install\n\t$(BIN)/yafsdp a -o $(DEMO)/x\n\trm -rf $(DEMO)\n\ntest:\n"
    bindir = str(Path(sys.executable).parent)
    assert demo_recipe(text) == [f"{bindir}/yafsdp a -o out/x", "rm -rf out"]


def run(line: str, cwd: Path, columns: int) -> str:
    # this checkout's yafsdp_cli, whichever checkout an editable install points at
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)}
    done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout + done.stderr


def rerunnable(line: str) -> bool:
    """A demo command that writes nothing: run again wide, it prints the same."""
    return "yafsdp " in line and " -o " not in line and "--update" not in line


def test_make_demo_runs_from_a_fresh_folder_and_reads_cleanly_at_80_columns(tmp_path):
    """Every line runs, at 80 columns; every table of it fits them, no column has no
    width and no word is broken or cut (each command that writes nothing is run again
    at 1,000 columns for the words it prints whole), and a line wider than 80 is one
    that holds a path (left whole for the terminal to wrap, so it can be copied)."""
    lines = demo_recipe((ROOT / "Makefile").read_text())
    assert any("yafsdp plan" in ln for ln in lines) and any("yafsdp convert" in ln for ln in lines)
    shutil.copytree(ROOT / "sample_models", tmp_path / "sample_models",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    problems = []
    for line in lines:
        narrow = run(line, tmp_path, 80)
        wide = run(line, tmp_path, 1000) if rerunnable(line) else narrow
        problems += [f"{line}\n{p}" for p in layout_problems(narrow, wide, 80)]
        problems += [f"{line}\nwider than 80: {t}" for t in narrow.splitlines()
                     if len(t) > 80 and "/" not in t]  # fmt: skip
    assert (tmp_path / "demo-out" / "llama.restored.safetensors").is_file()
    assert not problems, "\n".join(problems)
