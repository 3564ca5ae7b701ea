"""`yafsdp check`: CI memory-regression gate against a baseline JSON."""

from __future__ import annotations

from .app import app
from .common import fail


@app.command("check")
def check_command() -> None:
    """CI memory-regression gate against a baseline JSON."""
    raise fail("`yafsdp check` is not implemented yet")
