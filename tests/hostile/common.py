"""What every hostile case shares: the case record and a snapshot of a folder."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Case:
    """One bad input: ``build(folder)`` writes it and returns the path to give."""

    id: str
    build: Callable[[Path], Path]
    message: str  # a regex the one error line must match
    needs: str = ""  # "hf": transformers; "ro": a read-only folder
    commands: tuple[str, ...] = field(default=())
    # output cases: where to write, given the folder and the input (default: beside it)
    out: Callable[[Path, Path], Path] | None = None
    force: bool = False


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` (hidden ones too): kind and content digest.

    FIFOs are never opened; links are recorded by target, not followed."""
    out: dict[str, tuple] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            st = path.lstat()
            rel = str(path.relative_to(folder))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[rel] = (stat.S_IFMT(st.st_mode),)
    return out
