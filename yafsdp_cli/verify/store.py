"""What the original computed, kept on disk while the converted model runs.

One safetensors file per step in a private temporary folder: that step's outputs,
every gradient by name, every parameter and module buffer after the optimizer step
(names ``"<kind>/<name>"``). Files are written tensor by tensor straight from the
tensors' memory (no second copy of a model in RAM) and read back one tensor at a
time through ``safe_open``; a gradient that is ``None`` is remembered by name.
The folder is removed when the run ends, whatever happens.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..errors import YafsdpError

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensor_bytes(tensors: Mapping[str, torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """A safetensors file of ``tensors``, streamed (header first, then each tensor's
    bytes as they sit in memory)."""
    header, offset, ordered = {}, 0, []
    for name, t in tensors.items():
        t = t.detach()
        if t.dtype not in SAFETENSORS_DTYPES:
            raise YafsdpError(f"{name}: verify cannot keep a {t.dtype} tensor on disk")
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
        ordered.append(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in ordered:
            if t.numel():
                flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(flat.numpy()))


class StepFile(Mapping):
    """One step's stored tensors of one kind, loaded on access (a ``Mapping`` for
    ``Recorder.compare_all``); ``None`` for a gradient the original did not have."""

    def __init__(self, handle, kind: str, names: list[str], none: set[str]):
        self._handle, self._kind = handle, kind
        self._names = names
        self._none = none

    def __getitem__(self, name: str) -> torch.Tensor | None:
        if name in self._none:
            return None
        if name not in self._names:
            raise KeyError(name)
        return self._handle.get_tensor(f"{self._kind}/{name}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class ReferenceStore:
    """Per-step files in a temporary folder; a context manager that removes it."""

    def __init__(self, where: str | None = None):
        self._dir = Path(tempfile.mkdtemp(prefix="yafsdp-verify-", dir=where))
        self._names: dict[tuple[int, str], list[str]] = {}
        self._none: dict[tuple[int, str], set[str]] = {}

    def __enter__(self) -> ReferenceStore:
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def folder(self) -> Path:
        return self._dir

    def save_step(self, step: int, parts: Mapping[str, Mapping[str, torch.Tensor | None]]) -> None:
        """``parts``: kind -> name -> tensor (or None), written to one file."""
        flat: dict[str, torch.Tensor] = {}
        for kind, tensors in parts.items():
            self._names[(step, kind)] = list(tensors)
            self._none[(step, kind)] = {n for n, t in tensors.items() if t is None}
            flat.update({f"{kind}/{n}": t for n, t in tensors.items() if t is not None})
        try:
            write_tensors(self._file(step), flat)
        except OSError as exc:
            raise YafsdpError(
                f"verify could not keep the original's tensors in {self._dir} ({exc.strerror}); "
                "free disk space there, set TMPDIR to a larger disk, or give fewer --steps"
            ) from None

    def open_step(self, step: int, device: str = "cpu"):
        """A ``safe_open`` handle of the step's file (use as a context manager), its
        tensors loaded onto ``device``."""
        from safetensors import safe_open

        return safe_open(str(self._file(step)), framework="pt", device=device)

    def view(self, handle, step: int, kind: str) -> StepFile:
        key = (step, kind)
        return StepFile(handle, kind, self._names[key], self._none[key])

    def _file(self, step: int) -> Path:
        return self._dir / f"step{step}.safetensors"
