"""Hugging Face model folders (``config.json`` + weights) through the ``hf`` extra."""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError


def load_hf_folder(path: Path, *, trust_pickle: bool = False):
    raise SourceError(f"{path}: Hugging Face folders are not supported yet")
