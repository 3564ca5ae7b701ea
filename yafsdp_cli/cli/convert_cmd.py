"""`yafsdp convert`: Write a flat-buffer checkpoint."""

from __future__ import annotations

from .app import app
from .common import fail


@app.command("convert")
def convert_command() -> None:
    """Write a flat-buffer checkpoint."""
    raise fail("`yafsdp convert` is not implemented yet")


@app.command("restore")
def restore_command() -> None:
    """Flat-buffer checkpoint back to an ordinary state dict."""
    raise fail("`yafsdp restore` is not implemented yet")


@app.command("reshard")
def reshard_command() -> None:
    """Re-split a flat checkpoint for another rank count."""
    raise fail("`yafsdp reshard` is not implemented yet")
