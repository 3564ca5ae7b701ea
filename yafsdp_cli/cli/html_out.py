"""``--html FILE``: the option, and writing the page safely.

The page goes to a hidden temporary file beside FILE and is renamed into place, so
an error or Ctrl-C never leaves half a page. An existing FILE is replaced only if
it is an HTML page (``.html``/``.htm``): a mistyped ``--html model.safetensors``
must not destroy a checkpoint. FILE may not be the command's input.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ..errors import YafsdpError
from .command_kit import stderr

HtmlOpt = Annotated[
    Path | None,
    typer.Option(
        "--html",
        help="Also write a self-contained HTML report (layout bars, shards, memory) to FILE.",
        metavar="FILE",
    ),
]
HTML_SUFFIXES = (".html", ".htm")


def check_html_path(path: Path | None, *inputs: str | Path | None) -> None:
    """Refuse, before any work is done, a FILE that cannot or must not be written."""
    if path is None:
        return
    if path.is_dir():
        raise YafsdpError(f"--html {path}: is a folder; give a file name such as report.html")
    if path.exists() and path.suffix.lower() not in HTML_SUFFIXES:
        raise YafsdpError(
            f"--html {path}: exists and is not an .html file; refusing to overwrite it"
        )
    for item in inputs:
        if item is not None and Path(item).exists() and _same(Path(item), path):
            raise YafsdpError(f"--html {path}: is the input; give another file name")


def _same(a: Path, b: Path) -> bool:
    try:
        return b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_html(path: Path, page: str, *, quiet: bool = False) -> None:
    """Write ``page`` to ``path`` atomically (parent folders are created)."""
    data = page.encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise YafsdpError(f"--html {path}: cannot write there ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # what open() would have given it
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise YafsdpError(f"--html {path}: cannot write it ({exc.strerror})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if not quiet:
        stderr.print(f"wrote {path} ({len(data):,} bytes)", highlight=False, markup=False)
