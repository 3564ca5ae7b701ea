"""`yafsdp inspect`: Flat-buffer layout and per-rank memory report, baseline vs flat."""

from __future__ import annotations

from .app import app
from .common import fail


@app.command("inspect")
def inspect_command() -> None:
    """Flat-buffer layout and per-rank memory report, baseline vs flat."""
    raise fail("`yafsdp inspect` is not implemented yet")
