"""The README runs as written: its Python examples, and its shell blocks in order.

Shell blocks (```bash) run one command at a time, in order, in one fresh temporary
folder holding a copy of ``sample_models/`` (the README's commands name bundled
files and the folders ``python -m sample_models.hf_folders`` writes). ``make``
lines are skipped: they are this suite's own entry points (CI runs ``make test``).
A command whose line ends in ``# exit N`` must exit N, every other one 0. A ```text
block right after a shell block is output the README quotes: each of its lines must
appear in what that block printed (whitespace collapsed), so quoted figures are
what the code prints.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

BLOCK = re.compile(r"```bash\n(.*?)```(?:\s*```text\n(.*?)```)?", re.S)
EXIT = re.compile(r"#\s*exit (\d+)\s*$")


def test_readme_python_blocks_run(capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert "__flat__" in capsys.readouterr().out


def shell_blocks(text: str) -> list[tuple[list[str], str | None]]:
    out = []
    for body, quoted in BLOCK.findall(text):
        lines = body.replace("\\\n", " ").splitlines()
        commands = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith(("#", "make "))]
        out.append((commands, quoted or None))
    return out


def squash(text: str) -> str:
    return " ".join(text.split())


def test_the_block_reader():
    text = "```bash\nmake demo\nyafsdp a \\\n  --b  # exit 1\n```\n```text\nhello\n```\n"
    assert shell_blocks(text) == [(["yafsdp a    --b  # exit 1"], "hello\n")]


def test_readme_shell_blocks_run_in_order(tmp_path):
    pytest.importorskip("transformers")
    shutil.copytree(ROOT / "sample_models", tmp_path / "sample_models",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "COLUMNS": "1000"}
    env.pop("PYTHONPATH", None)
    ran = 0
    for commands, quoted in shell_blocks((ROOT / "README.md").read_text()):
        printed = ""
        for command in commands:
            want = int(m.group(1)) if (m := EXIT.search(command)) else 0
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            printed += done.stdout + done.stderr
            assert done.returncode == want, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            ran += 1
        for line in (quoted or "").splitlines():
            assert squash(line) in squash(printed), (
                f"README quotes {line!r}; today it printed:\n{printed[-3000:]}"
            )
    assert ran >= 10, "the README has (almost) no runnable shell command"
