"""``.pt`` / ``.pth`` / ``.bin`` files: state dicts, and pickled modules refused by default.

State dicts load with ``torch.load(weights_only=True, mmap=True)``: no code from the
file runs, and tensor data stays on disk until read. A file that pickles a whole
``nn.Module`` fails that load; we then read the pickle's opcodes (without running
them) to name the class, and refuse unless ``--trust-pickle`` is given.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..engine import dtypes
from ..errors import SourceError, cut
from ..fileio import read_json
from .loaded import ReaderBase, cwd_importable
from .pickle_guard import PickleShapeError, check_pickle
from .shards import shard_names, shard_path

# data.pkl holds names and shapes, about 200 bytes a tensor: 256 MB is a million
# tensors. The legacy format opens with five pickles before its tensor bytes.
MAX_PICKLE_BYTES = 256 * 1024 * 1024
_LEGACY_PICKLES = 5
_NESTED_KEYS = ("state_dict", "model_state_dict", "model", "module", "weights")
_SAFE_GLOBAL_PREFIXES = ("torch.", "collections.", "builtins.", "_codecs.", "numpy.")


def load_torch_file(path: Path, *, trust_pickle: bool) -> tuple[object, list[str]]:
    """The object in ``path`` (a state dict or, if trusted, a module) and notes."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic[:2] != b"PK" and magic[:1] != b"\x80":  # torch.save: a zip, or a protocol-2 pickle
        raise SourceError(
            f"{path}: not a torch file (neither a zip archive nor a pickle); "
            "give a file written by torch.save"
        )
    _check_opcodes(path)
    try:
        return _load(path, weights_only=True), []
    except pickle.UnpicklingError as exc:
        classes = pickled_classes(path)
        if not classes:
            raise SourceError(f"{path}: cannot load safely ({_first_line(exc)})") from None
        if not trust_pickle:
            raise SourceError(
                f"{path} holds a pickled {classes[0]}; loading it runs code from the file. "
                "Pass --trust-pickle if you trust it, or save model.state_dict() instead"
            ) from None
    cwd_importable()  # the pickle's classes are found where the user runs, as --model's
    try:
        return _load(path, weights_only=False), [f"loaded a pickled {classes[0]} (--trust-pickle)"]
    except ModuleNotFoundError as exc:
        raise SourceError(
            f"{path}: the pickled {classes[0]} needs module {exc.name!r}, which cannot be "
            f"imported from {os.getcwd()}; run from the folder that holds it, or add that "
            "folder to PYTHONPATH"
        ) from None
    except Exception as exc:  # the pickle's own code failed: name the class it wanted
        raise SourceError(f"{path}: unpickling {classes[0]} failed ({_first_line(exc)})") from None


def _load(path: Path, *, weights_only: bool):
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    except pickle.UnpicklingError:
        raise
    except RuntimeError as exc:
        if "mmap" in str(exc) or "zip" in str(exc).lower():  # legacy (non-zip) format
            try:
                return torch.load(path, map_location="cpu", weights_only=weights_only)
            except pickle.UnpicklingError:
                raise
            except Exception as inner:
                raise SourceError(
                    f"{path}: not a readable torch file ({_first_line(inner)})"
                ) from None
        raise SourceError(f"{path}: not a readable torch file ({_first_line(exc)})") from None
    except (EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise SourceError(f"{path}: not a readable torch file ({_first_line(exc)})") from None
    except Exception as exc:
        if not weights_only:
            raise
        # a weights-only load runs nothing from the file: whatever it raises (a
        # TypeError of a rebuild function given the wrong arguments, an unhashable
        # key) is the file's damage
        raise SourceError(
            f"{path}: not a readable torch file ({type(exc).__name__}: {cut(_first_line(exc))})"
        ) from None


def _check_opcodes(path: Path) -> None:
    """Refuse a file whose pickles would crash or exhaust any unpickler, torch's
    included (``pickle_guard``): every ``.pkl`` member of a zip archive; of the legacy
    format, the pickles it starts with (magic number, protocol, system, the object,
    its storage keys), which come before the tensor bytes."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    if not info.filename.endswith(".pkl"):
                        continue
                    if info.file_size > MAX_PICKLE_BYTES:
                        raise PickleShapeError(
                            f"{info.filename} of {info.file_size} bytes, over the "
                            f"{MAX_PICKLE_BYTES} a pickle of tensors ever needs"
                        )
                    check_pickle(z.read(info))
            return
        head = _pickle_bytes(path)
        stream = io.BytesIO(head)
        for _ in range(_LEGACY_PICKLES):
            if stream.tell() >= len(head):
                break
            check_pickle(stream, len(head))
    except PickleShapeError as exc:
        raise SourceError(f"{path}: not a readable torch file ({cut(str(exc))})") from None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise SourceError(f"{path}: not a readable torch file ({cut(_first_line(exc))})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def pickled_classes(path: Path) -> list[str]:
    """Globals a pickle would import, read from its opcodes without running them;
    torch's and the standard library's own come last."""
    stream = io.BytesIO(_pickle_bytes(path))
    found: list[str] = []
    strings: list[str] = []
    try:  # the legacy format is several pickles one after another: read them all
        while stream.tell() < len(stream.getbuffer()):
            for op, arg, _ in pickletools.genops(stream):
                if op.name == "GLOBAL":
                    found.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str):
                    strings.append(arg)
    except Exception:  # a truncated pickle still tells us what it named so far
        pass
    found = list(dict.fromkeys(found))
    return sorted(found, key=lambda g: g.startswith(_SAFE_GLOBAL_PREFIXES))


def _pickle_bytes(path: Path) -> bytes:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
            return z.read(name) if name else b""
    return path.read_bytes()[: 64 * 1024 * 1024]


def find_state_dict(obj: object, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensor dict in a loaded file: the file itself or a training checkpoint's
    ``state_dict`` / ``model`` entry."""
    if _is_tensor_dict(obj):
        return dict(obj), []
    if isinstance(obj, dict):
        for key in _NESTED_KEYS:
            if _is_tensor_dict(obj.get(key)):
                return dict(obj[key]), [f"weights taken from the checkpoint's {key!r} entry"]
        keys = ", ".join(map(repr, list(obj)[:8]))
        raise SourceError(f"{path}: no state dict found; top-level keys are {keys}")
    raise SourceError(f"{path}: holds a {type(obj).__name__}, not a state dict or module")


def load_torch_index(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded ``pytorch_model.bin.index.json`` set, each shard loaded
    with ``weights_only=True`` and mmap; the weight_map must match the shards."""
    index = read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceError(f"{path}: no weight_map; is this a checkpoint index?")
    tensors: dict[str, torch.Tensor] = {}
    for file in shard_names(path, weight_map):
        shard = shard_path(path, file)
        obj, _ = load_torch_file(shard, trust_pickle=False)
        part, _ = find_state_dict(obj, shard)
        for name, t in part.items():
            if weight_map.get(name) != file:
                raise SourceError(
                    f"{path}: {file} holds {name!r}, but the weight_map puts it in "
                    f"{weight_map.get(name)!r}"
                )
            tensors[name] = t
    missing = [n for n in weight_map if n not in tensors]
    if missing:
        raise SourceError(f"{path}: weight_map names {missing[:3]}, which no shard it names holds")
    return tensors


def _is_tensor_dict(obj: object) -> bool:
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def shared_names(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Canonical name -> other names viewing the very same data (tied weights)."""
    first: dict[tuple, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or not t.numel():
            continue
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key in first:
            aliases.setdefault(first[key], []).append(name)
        else:
            first[key] = name
    return aliases


class TensorDictReader(ReaderBase):
    """Byte access to in-memory (or mmapped) tensors by name."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def nbytes(self, name: str) -> int:
        t = self.tensors[name]
        return t.numel() * t.element_size()

    def iter_bytes(self, name: str, chunk: int = 16 * 1024 * 1024) -> Iterator[memoryview]:
        t = self.tensors[name].detach()
        if not t.numel():
            return
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()  # (nbytes,), no copy
        view = memoryview(raw)
        for start in range(0, len(view), chunk):
            yield view[start : start + chunk]

    def load(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def dtype(self, name: str) -> str:
        return dtypes.from_torch(self.tensors[name].dtype)


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every persistent tensor of a module by every name, detached."""
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
