"""Unsafe outputs: the input again (through a link or a ``./`` spelling), a missing
folder, a read-only folder, an existing folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import SAMPLES

from .common import Case
from .flat_cases import make_flat

OUTPUT_COMMANDS = ("convert", "restore", "reshard")
RO = "ro"  # the read-only folder's name (a read-only mount, made by the test)


def inputs(folder: Path) -> Path:
    """A source for convert and a flat checkpoint for restore/reshard."""
    shutil.copyfile(SAMPLES / "mlp.safetensors", folder / "x.safetensors")
    make_flat(folder)
    return folder / "x.safetensors"


def source_for(command: str, folder: Path) -> Path:
    return folder / ("x.safetensors" if command == "convert" else "flat.safetensors")


def _link(folder: Path, src: Path) -> Path:
    link = folder / "link.safetensors"
    if not link.is_symlink():
        link.symlink_to(src)
    return link


def _dotted(folder: Path, src: Path) -> Path:
    (folder / "sub").mkdir(exist_ok=True)
    return Path(f"{folder}/./sub/../{src.name}")


def _existing_folder(folder: Path, src: Path) -> Path:
    (folder / "there.safetensors").mkdir(exist_ok=True)
    return folder / "there.safetensors"


OUTPUTS = [
    Case("out-is-input-via-symlink", inputs, "output .*link.safetensors is the input", out=_link),
    Case("out-is-input-dotted", inputs, "output .* is the input", out=_dotted),
    Case(
        "out-in-missing-folder",
        inputs,
        "o.safetensors: its folder .*nope does not exist",
        out=lambda f, s: f / "nope" / "o.safetensors",
    ),
    Case(
        "out-in-read-only-folder",
        inputs,
        "cannot write .*o.safetensors \\((Read-only file system|Permission denied)",
        needs="ro",
        out=lambda f, s: f / RO / "o.safetensors",
    ),
    Case(
        "out-onto-existing-folder",
        inputs,
        "output .*there.safetensors is a folder",
        out=_existing_folder,
        force=True,
    ),
    Case(
        "out-onto-existing-folder-no-force",
        inputs,
        "there.safetensors exists; pass --force",
        out=_existing_folder,
    ),
]
for _c in OUTPUTS:
    _c.commands = OUTPUT_COMMANDS
