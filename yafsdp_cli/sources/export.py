"""``torch.export`` programs (``*.pt2``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError


def load_export(path: Path):
    raise SourceError(f"{path}: torch.export programs are not supported yet")
