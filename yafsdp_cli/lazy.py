"""Package names that are imported when first used, not when the package is.

A command pays for every module it imports before it copies a byte, and a
frozen dataclass costs about half a millisecond to build: ``restore`` has no use
for the source readers or ``convert``'s planning. A package lists where each name
lives, imports those modules only under ``TYPE_CHECKING`` (so readers, type checkers
and ``tests/house/test_house.py`` still see the edges), and forwards its module
``__getattr__`` to ``attribute``.
"""

from __future__ import annotations

import importlib


def attribute(package: str, homes: dict[str, str], name: str):
    """``name`` from the submodule of ``package`` that ``homes`` names for it."""
    if name not in homes:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
