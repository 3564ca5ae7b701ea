"""`yafsdp profile`: Measured peak memory of a training step, original vs converted."""

from __future__ import annotations

from .app import app
from .common import fail


@app.command("profile")
def profile_command() -> None:
    """Measured peak memory of a training step, original vs converted."""
    raise fail("`yafsdp profile` is not implemented yet")
