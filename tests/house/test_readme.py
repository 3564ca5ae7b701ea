"""The README and every page of docs/ run as written: their Python examples, and their
shell blocks in order, and every option they give a command is one it has.

Each page's shell blocks (```bash) run one command at a time, in order, in one fresh
temporary folder of that page's own, holding a copy of ``sample_models/`` and the
folders ``python -m sample_models.hf_folders .`` writes (the pages name bundled
files and those folders; the README's first block is that command, which the suite
runs once for every page). ``make`` lines
are skipped: they are this suite's own entry points (CI runs ``make test``). A
command whose line ends in ``# exit N`` must exit N, every other one 0. A ```text
block right after a shell block is output the page quotes: each of its lines must
appear in what that block printed (whitespace collapsed), so quoted output is what
the code prints now.

A shell block whose first line is ``# slow: REASON`` is run only with
``YAFSDP_DOCS_SLOW=1`` in the environment (the reason says what makes it slow); the
option check below covers its commands either way. Python blocks (```python) run in
the repository root, each in a namespace of its own.
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
SLOW = re.compile(r"#\s*slow:\s*(\S.*)$")
SETUP = "python -m sample_models.hf_folders ."  # run once, by the workspace fixture
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
RUN_SLOW = os.environ.get("YAFSDP_DOCS_SLOW") == "1"


def test_the_docs_pages_are_there():
    names = {p.name for p in PAGES}
    for page in ("plan", "inspect", "checkpoints", "verify", "profile", "ci-gate", "dcp",
                 "library", "security", "design"):  # fmt: skip
        assert f"{page}.md" in names
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
    assert len(readme.splitlines()) <= 320, "the README is a summary; details go to docs/"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_blocks_run(page, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        exec(compile(block, str(page.relative_to(ROOT)), "exec"), {})
    if page.name == "checkpoints.md":  # the reader of the file format found the buffers
        assert "__flat__" in capsys.readouterr().out


def shell_blocks(text: str) -> list[tuple[list[str], str | None, str | None]]:
    """``(commands, quoted output, slow reason)`` for each shell block."""
    out = []
    for body, quoted in BLOCK.findall(text):
        lines = body.replace("\\\n", " ").splitlines()
        slow = SLOW.match(lines[0].strip()) if lines else None
        commands = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith(("#", "make "))]
        out.append((commands, quoted or None, slow.group(1) if slow else None))
    return out


def squash(text: str) -> str:
    return " ".join(text.split())


def test_the_block_reader():
    text = "```bash\nmake demo\nyafsdp a \\\n  --b  # exit 1\n```\n```text\nhello\n```\n"
    assert shell_blocks(text) == [(["yafsdp a    --b  # exit 1"], "hello\n", None)]
    slow = "```bash\n# slow: 30 s of fake runs\nyafsdp plan x\n```\n"
    assert shell_blocks(slow) == [(["yafsdp plan x"], None, "30 s of fake runs")]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A folder holding what the pages' commands name: the bundled sample models and
    the Hugging Face folders ``python -m sample_models.hf_folders .`` writes."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("docs-workspace")
    shutil.copytree(ROOT / "sample_models", root / "sample_models",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    done = subprocess.run(SETUP.replace("python", sys.executable, 1), shell=True, cwd=root,
                          env=clean_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def clean_env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    # this checkout's yafsdp_cli, whichever checkout an editable install points at
    # (sample_models still comes from the page's folder: the CLI puts it first)
    path = {"PATH": bindir + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    return {**os.environ, **path, "COLUMNS": "1000"}


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_shell_blocks_run_in_order(page, workspace, tmp_path):
    here = tmp_path / "repo"
    shutil.copytree(workspace, here)
    env = clean_env()
    ran = skipped = 0
    for commands, quoted, slow in shell_blocks(page.read_text()):
        if slow and not RUN_SLOW:
            skipped += len(commands)
            continue
        printed = ""
        for command in commands:
            if command.startswith(SETUP):  # the workspace holds what it writes
                continue
            want = int(m.group(1)) if (m := EXIT.search(command)) else 0
            done = subprocess.run(["bash", "-c", command], cwd=here, env=env,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            printed += done.stdout + done.stderr
            assert done.returncode == want, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            ran += 1
        for line in (quoted or "").splitlines():
            assert squash(line) in squash(printed), (
                f"{page.name} quotes {line!r}; it printed:\n{printed[-3000:]}"
            )
    if page.name == "README.md":
        assert ran >= 8, "the README has (almost) no runnable shell command"
    elif not ran and not skipped:
        pytest.skip(f"{page.name} has no shell block")


# --- every option the docs give a command is one it has ----------------------------

CODE_SPAN = re.compile(r"```(?:bash|yaml|text)?\n(.*?)```|`([^`\n]+)`", re.S)
COMMAND = re.compile(r"\byafsdp\s+(?:--debug\s+)?([a-z]+)\b([^\n|>#]*)")
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def command_options() -> dict[str, set[str]]:
    import typer

    from yafsdp_cli.cli import load_commands

    group = typer.main.get_command(load_commands())
    options = {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
               for name, cmd in group.commands.items()}  # fmt: skip
    options[""] = {o for p in group.params for o in (*p.opts, *p.secondary_opts)}
    return options


def documented_commands(text: str) -> list[tuple[str, list[str], str]]:
    """``(command, options, the line)`` for each ``yafsdp COMMAND ...`` in code."""
    found = []
    for block, span in CODE_SPAN.findall(text):
        for line in (block or span).replace("\\\n", " ").splitlines():
            for name, rest in COMMAND.findall(line):
                flags = [f.split("=")[0] for f in FLAG.findall(rest)]
                found.append((name, flags, line.strip()))
    return found


def test_the_option_reader():
    line = "yafsdp inspect x --world-size 8 --json > a  # --nope"
    text = f"```bash\n{line}\n```\n`yafsdp verify y -n=2`"
    assert documented_commands(text) == [
        ("inspect", ["--world-size", "--json"], line),
        ("verify", ["-n"], "yafsdp verify y -n=2"),
    ]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_documented_option_exists(page):
    options = command_options()
    seen = 0
    for name, flags, line in documented_commands(page.read_text()):
        if name not in options:
            continue  # prose such as "yafsdp flat" (the scheme), not a command line
        for flag in flags:
            assert flag in options[name] | options[""], f"{page.name}: {name} has no {flag}: {line}"
        seen += 1
    if page.name == "README.md":
        assert seen >= 8
