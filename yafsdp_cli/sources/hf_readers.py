"""Readers for Hugging Face folders whose stored names are not the module's names."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from .loaded import ReaderBase


class RenamedReader:
    """A reader that answers to the architecture's names for differently stored ones."""

    def __init__(self, reader, mapping: dict[str, str]):
        self.reader, self.mapping = reader, mapping
        self.back = {v: k for k, v in mapping.items()}

    def names(self) -> list[str]:
        return [self.back.get(n, n) for n in self.reader.names()]

    def nbytes(self, name: str) -> int:
        return self.reader.nbytes(self.mapping.get(name, name))

    def iter_bytes(self, name: str, *args, **kwargs):
        return self.reader.iter_bytes(self.mapping.get(name, name), *args, **kwargs)

    def file_ranges(self, name: str):
        return self.reader.file_ranges(self.mapping.get(name, name))

    def check_copied(self, crc_of) -> None:
        self.reader.check_copied(crc_of)

    def files(self) -> list[Path]:
        return self.reader.files()

    def load(self, name: str):
        return self.reader.load(self.mapping.get(name, name))


class PretrainedReader(ReaderBase):
    """Tensors as ``from_pretrained`` makes them, loaded (for real) on first use."""

    def __init__(self, build, path: Path):
        self.build, self.path = build, path
        self._tensors: dict[str, Any] | None = None

    def _all(self) -> dict[str, Any]:
        if self._tensors is None:
            from .torch_file import TensorDictReader, module_tensors

            with quiet_transformers():
                model = self.build.pretrained(self.path)
            self._tensors = module_tensors(model)
            self._dict = TensorDictReader(self._tensors)
        return self._tensors

    def names(self) -> list[str]:
        return list(self._all())

    def nbytes(self, name: str) -> int:
        self._all()
        return self._dict.nbytes(name)

    def iter_bytes(self, name: str, *args, **kwargs):
        self._all()
        return self._dict.iter_bytes(name, *args, **kwargs)

    def load(self, name: str):
        return self._all()[name]


@contextlib.contextmanager
def quiet_transformers():
    """transformers logs config warnings and progress bars; a report has no use for them."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        logging.enable_progress_bar()
