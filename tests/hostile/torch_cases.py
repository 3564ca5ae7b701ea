"""Bad ``.pt`` / ``.bin`` files: not zip, zips without the pickle, pickles that run code."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

from .common import Case
from .st_cases import SOURCE_COMMANDS

MARKER = "PWNED"  # what the evil pickles would create beside themselves


class _Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _not_zip(folder: Path) -> Path:
    path = folder / "x.pt"
    path.write_bytes(b"this is neither a zip archive nor a pickle\n" * 4)
    return path


def _zip_without_pickle(folder: Path) -> Path:
    path = folder / "x.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/version", "3\n")
        z.writestr("archive/data/0", b"\0" * 16)
    return path


def _evil(kind: str):
    def build(folder: Path) -> Path:
        import torch

        path = folder / ("x.bin" if kind == "raw" else "x.pt")
        payload = {"w": _Evil(folder / MARKER)}
        if kind == "raw":
            path.write_bytes(pickle.dumps(payload, protocol=2))
        else:
            torch.save(payload, path, _use_new_zipfile_serialization=kind == "zip")
        return path

    return build


def _truncated_zip(folder: Path) -> Path:
    import torch

    path = folder / "x.pt"
    torch.save({"a": torch.ones(1000)}, path)
    os.truncate(path, 300)
    return path


TORCH = [
    Case("pt-not-zip", _not_zip, "x.pt: not a torch file"),
    Case("pt-zip-without-pickle", _zip_without_pickle, "x.pt: not a readable torch file"),
    Case("pt-truncated-zip", _truncated_zip, "x.pt: not a readable torch file"),
    Case("pt-code-zip", _evil("zip"), "holds a pickled (posix|os).system; loading it runs code"),
    Case("pt-code-legacy", _evil("legacy"), "holds a pickled (posix|os).system; loading it runs"),
    Case("pt-code-raw-pickle", _evil("raw"), "holds a pickled (posix|os).system; loading it runs"),
]
for _c in TORCH:
    _c.commands = SOURCE_COMMANDS
