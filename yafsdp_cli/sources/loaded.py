"""What every source loads into: ``LoadedModel`` and the reader protocol.

A ``LoadedModel`` is a ``ModelSpec`` (names, shapes, dtypes, units), a reader for
tensor bytes when there are weights, and the architecture when one is known.
``build_module()`` makes a real module with the weights. torch is imported only
when a module is built.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..engine.records import ModelSpec, TensorRecord
from ..errors import SourceError

NO_ARCH_NOTE = (
    "no architecture: every floating-point tensor counts as a parameter (module buffers "
    "such as BatchNorm statistics included); give --model for module kinds and tied weights"
)


def cwd_importable() -> None:
    """Put the current directory on ``sys.path``, as ``python -m`` and ``uvicorn
    app:app`` do: code named by ``--model`` or by a pickle is found where the user runs."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


class TensorReader(Protocol):
    """Byte access to a source's tensors (names as stored; tied names may be absent),
    and everything ``convert`` asks of a reader: where the bytes lie, so that they can
    be copied file to file, and the files read, so that an output is never one of
    them. ``ReaderBase`` gives the answers of a reader with no files behind it."""

    def names(self) -> list[str]: ...

    def nbytes(self, name: str) -> int: ...

    def iter_bytes(self, name: str, chunk: int = ...) -> Any: ...  # Iterator[memoryview]

    def load(self, name: str) -> Any: ...  # torch.Tensor

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """``(path, offset, nbytes)`` of each piece of the tensor's bytes, in order, or
        None where they are not plain file bytes (held in memory, or read by torch)."""
        ...

    def check_copied(self, crc_of) -> None:
        """After a copy of ranges handed out by ``file_ranges``: check them against
        what the reader knows (a stored CRC-32); ``crc_of(path, offset, nbytes)`` is
        the CRC of a range as the copier read it back."""
        ...

    def files(self) -> list[Path]:
        """The files whose bytes the reader gives (an output must be none of them)."""
        ...


class ReaderBase:
    """A reader's optional capabilities, for one with no files behind it: no ranges to
    copy, nothing to check after a copy, no files read."""

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        return None

    def check_copied(self, crc_of) -> None:
        return None

    def files(self) -> list[Path]:
        return []


@dataclass
class LoadedModel:
    spec: ModelSpec
    reader: TensorReader | None = None  # None: an architecture without weights
    module: Any = None  # nn.Module (meta device unless the source held real weights)
    factory: Any = None  # zero-argument callable that builds the architecture
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def stored_name(self, record: TensorRecord) -> str:
        """The name under which the reader holds ``record`` (a tied name may be the one)."""
        if self.reader is None:
            raise SourceError(f"{self.spec.source or 'this source'} has no weights")
        available = self._reader_names()
        for n in record.names:
            if n in available:
                return n
        raise SourceError(f"the weights have no tensor {record.name!r}")

    def _reader_names(self) -> set[str]:
        if "names" not in self.extra:
            self.extra["names"] = set(self.reader.names())
        return self.extra["names"]

    def build_module(self):
        """A real module with this source's weights (see ``factory.build_with_weights``)."""
        return build_with_weights(self)


def build_with_weights(loaded: LoadedModel):
    """A real CPU module: the pickled one, or the factory's filled with the weights."""
    import torch

    if loaded.module is not None and not _is_meta(loaded.module):
        return loaded.module
    if loaded.factory is None:
        raise SourceError(
            f"{loaded.spec.source}: running the model needs its architecture; give "
            "--model package.module:factory (or a Hugging Face folder with config.json)"
        )
    torch.manual_seed(0)
    module = loaded.factory()
    if loaded.reader is not None:
        load_weights(module, loaded)
    return module


def _is_meta(module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def load_weights(module, loaded: LoadedModel) -> None:
    """Copy the reader's tensors into ``module`` in place, keeping ties and taking
    the stored dtypes."""
    import torch

    from ..engine.module_spec import collect_tensors

    by_name = loaded.spec.by_name()
    with torch.no_grad():
        for item in collect_tensors(module):
            record = by_name.get(item.names[0])
            if record is None or not record.persistent:
                continue
            src = loaded.reader.load(loaded.stored_name(record))
            if item.tensor.dtype != src.dtype:
                item.tensor.data = item.tensor.data.to(src.dtype)
            item.tensor.copy_(src)
