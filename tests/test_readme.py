"""The README's Python examples run as written."""

from __future__ import annotations

import re

from conftest import ROOT


def test_readme_python_blocks_run(capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert "__flat__" in capsys.readouterr().out
