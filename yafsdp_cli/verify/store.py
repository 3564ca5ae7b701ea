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


def keep_on_disk(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """``write_tensors``; a failure (disk full) is one sentence saying what to do."""
    try:
        write_tensors(path, tensors)
    except OSError as exc:
        raise YafsdpError(
            f"verify could not keep tensors in {path.parent} ({exc.strerror}); "
            "free disk space there, set TMPDIR to a larger disk, or give fewer --steps"
        ) from None


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


TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class StepReader:
    """Tensors of one file read with plain reads, not a memory map: mapped pages
    that were read would count in this process's RSS until the file is closed,
    a second model's worth of them by the end of a step."""

    def __init__(self, path: Path, device: str = "cpu"):
        self._f = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        n = int.from_bytes(self._f.read(8), "little")
        self._header = json.loads(self._f.read(n))
        self._base = 8 + n
        self._device = device

    def __enter__(self) -> StepReader:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def names(self) -> list[str]:
        """The file's tensor names, in its order."""
        return [k for k in self._header if k != "__metadata__"]

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._header[name]
        start, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=TORCH_DTYPES[info["dtype"]])
        if end > start:
            self._f.seek(self._base + start)
            self._f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return t if self._device == "cpu" else t.to(self._device)


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
        keep_on_disk(self._file(step), flat)

    def open_step(self, step: int, device: str = "cpu") -> StepReader:
        """A reader of the step's file (use as a context manager), its tensors loaded
        onto ``device``."""
        return StepReader(self._file(step), device)

    def view(self, handle, step: int, kind: str) -> StepFile:
        key = (step, kind)
        return StepFile(handle, kind, self._names[key], self._none[key])

    def _file(self, step: int) -> Path:
        return self._dir / f"step{step}.safetensors"
