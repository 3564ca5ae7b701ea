"""``restore`` to one file: ``.safetensors`` (streamed) or ``torch.save`` (``.pt``).

A ``.safetensors`` output is copied by byte ranges out of the flat files and read
once: each range is copied and checksummed in one pass (``file_ranges.Copier`` with
a ledger), then ``FlatCheckpoint.verify`` combines those checksums with what was not
copied (padding, replicas), read there, and compares them with the stored ones before
the output is renamed. Tied names follow ``safetensors.torch.save_model``: a tied
tensor is stored once, under its first name, and the metadata maps each dropped name
to the stored one, so ``safetensors.torch.load_model(model, path)`` and yafsdp itself
see the tie.

A ``.pt`` output is ``torch.save`` of a dict with every name, tied names sharing one
tensor; it holds the model in memory once, so the input is verified first. A
checkpoint with optimizer state from a ``torch.save`` source is written in that
source's nesting (``write_training_pt``): weights and state tensors under their key
paths, the record's other values beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...engine import dtypes
from ..file_ranges import Copier
from ..format import YAFSDP_KEYS
from ..reader import FlatCheckpoint
from ..results import Progress, RestoreResult, restored
from ..writer import check_output, page_phase, staged_output, torch_save, write_safetensors
from .read_back import extras_of, nest, read_tensor


def restore_file(
    ckpt: FlatCheckpoint,
    out: Path,
    fmt: str,
    items: list,
    *,
    force: bool,
    progress: Progress | None,
) -> RestoreResult:
    """Write ``items`` (``read_back.state_dict_items(ckpt)``) to ``out`` as ``fmt``
    (``safetensors`` or ``pt``); every checksum and the zero padding of ``ckpt`` are
    verified before it appears."""
    check_output(out, inputs=list(ckpt.paths), force=force, folder=False)
    copier = Copier(record=True)
    tied = {a: it.slot.name for it in items for a in it.aliases}
    with staged_output(out, folder=False, force=force) as staged:
        if fmt == "pt":
            checked = ckpt.verify(progress, copier)  # before anything is held in memory
            _write_pt(staged.temp, items, progress)
        else:
            meta = _metadata(ckpt, tied)
            write_safetensors(staged.temp, items, meta, progress, copier, page_phase(ckpt.paths))
            checked = ckpt.verify(progress, copier)  # reads only what was not copied
        nbytes = staged.temp.stat().st_size
    return restored(
        ckpt, out, nbytes=nbytes, checked=checked, fmt=fmt, tensors=len(items), tied=tied
    )


def write_training_pt(
    ckpt: FlatCheckpoint, out: Path, tensors: dict, *, force: bool, progress: Progress | None
) -> tuple[int, int]:
    """The training checkpoint ``ckpt`` as ``torch.save`` of its source's nesting:
    ``tensors`` (``read_back.training_items``) and the record's other values, each
    under its key path. Returns (bytes written, tensors checked)."""
    check_output(out, inputs=list(ckpt.paths), force=force, folder=False)
    checked = ckpt.verify(progress)
    read: dict[int, Any] = {}  # one tensor per item: tied names share it, as in the model
    values = {}
    for path, it in tensors.items():
        if id(it) not in read:
            read[id(it)] = read_tensor(it)
        values[path] = read[id(it)]
    values.update(extras_of(ckpt.optim))
    with staged_output(out, folder=False, force=force) as staged:
        torch_save(nest(values), staged.temp)
        nbytes = staged.temp.stat().st_size
    return nbytes, checked


def _metadata(ckpt: FlatCheckpoint, tied: dict[str, str]) -> dict[str, str]:
    """The source's own metadata (minus stale tie records), ties, ``format: pt``."""
    names = {it for b in ckpt.layout.buffers for e in b.entries for it in e.names}
    names |= {n for t in ckpt.layout.kept for n in t.names}
    meta = {
        k: v for k, v in ckpt.source_metadata.items() if k not in names and k not in YAFSDP_KEYS
    }
    return {**meta, **tied, "format": "pt"}


def _write_pt(path: Path, items, progress) -> None:
    import torch

    state: dict = {}
    total, done = sum(it.slot.nbytes for it in items), 0
    for it in items:
        data = bytearray(it.slot.nbytes)
        pos = 0
        for chunk in it.read():
            data[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        dtype = dtypes.to_torch(it.slot.dtype)
        if data:
            tensor = torch.frombuffer(data, dtype=dtype).reshape(it.slot.shape)
        else:
            tensor = torch.empty(it.slot.shape, dtype=dtype)
        for name in (it.slot.name, *it.aliases):
            state[name] = tensor
        done += len(data)
        if progress is not None:
            progress("writing", done, total)
    torch_save(state, path)
