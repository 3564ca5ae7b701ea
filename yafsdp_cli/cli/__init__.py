"""The ``yafsdp`` command line: thin commands over the library.

Each command parses its options, calls one library function, renders the result
with ``yafsdp_cli.report`` and sets the exit code (0 ok, 1 a check failed, 2 bad
usage or unusable input). Only this package imports Typer and Rich.
"""

from __future__ import annotations

from . import check_cmd, convert_cmd, inspect_cmd, profile_cmd, verify_cmd  # noqa: F401
from .app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
