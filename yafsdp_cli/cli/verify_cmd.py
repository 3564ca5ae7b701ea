"""`yafsdp verify`: Forward/backward check of the converted model against the original."""

from __future__ import annotations

from .app import app
from .common import fail


@app.command("verify")
def verify_command() -> None:
    """Forward/backward check of the converted model against the original."""
    raise fail("`yafsdp verify` is not implemented yet")
