"""``restore --format trainer``: a Hugging Face Trainer checkpoint folder back.

The folder holds what the Trainer's folder held: each weights file (``model.safetensors``
or the shards) with the tensor names it stored, in their dtypes and the source's own
safetensors metadata; ``optimizer.pt``, ``torch.save`` of the optimizer state dict
rebuilt from its key paths (the same parameter numbers, param groups and step
counts, the state tensors bit for bit out of the state buffers); and every other file
(``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ``config.json``, ...)
byte for byte out of the optimizer record. ``Trainer.train(resume_from_checkpoint=...)``
resumes from it as from the original.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ...errors import CheckpointError
from ..file_ranges import Copier
from ..format import YAFSDP_KEYS
from ..optim_state import file_bytes
from ..reader import FlatCheckpoint, StateDictItem
from ..results import Progress, RestoreResult, restored
from ..writer import existing_folder_output, staged_output, torch_save, write_safetensors
from .read_back import extras_of, nest, read_tensor, training_items

OPTIMIZER_FILE = "optimizer.pt"
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def restore_trainer(
    ckpt: FlatCheckpoint, out: Path, items: list, *, force: bool, progress: Progress | None
) -> RestoreResult:
    """Write ``ckpt`` (converted from a Trainer folder) back as that folder at ``out``."""
    optim = ckpt.optim
    names = {*optim.weights, OPTIMIZER_FILE, *optim.files}
    check_trainer_output(out, inputs=list(ckpt.paths), force=force, names=names)
    files = file_bytes(optim, str(ckpt.root))  # every check before anything is written
    copier = Copier(record=True)
    with staged_output(out, folder=True, force=force) as staged:
        for name, stored in optim.weights.items():
            _write_weights(ckpt, staged.temp / name, _stored_items(items, stored), progress, copier)
        checked = ckpt.verify(progress, copier)  # reads only what was not copied
        _write_optimizer(ckpt, items, staged.temp / OPTIMIZER_FILE)
        for name, data in files.items():
            (staged.temp / name).write_bytes(data)
        nbytes = sum(p.stat().st_size for p in staged.temp.iterdir())
    tensors = sum(len(v) for v in optim.weights.values())
    return restored(ckpt, out, nbytes=nbytes, checked=checked, fmt="trainer", tensors=tensors)


def check_trainer_output(out: Path, *, inputs: list[Path], force: bool, names: set[str]) -> None:
    """Refuse a file name, an input, an existing output without ``--force``, and a
    folder holding anything but a Trainer folder's files (never replaced, even forced)."""
    if out.name.endswith(_FILE_SUFFIXES):
        raise CheckpointError(
            f"output {out}: --format trainer writes a folder (model.safetensors, "
            "optimizer.pt, ...); give a folder name without a file suffix"
        )
    if not out.parent.is_dir():
        raise CheckpointError(f"output {out}: its folder {out.parent} does not exist")
    found = existing_folder_output(out, inputs=inputs, force=force, kind="a Trainer checkpoint")
    if found is None:
        return
    strangers = sorted(n for n in found if n not in names)
    if strangers:
        raise CheckpointError(
            f"output {out} is a folder that holds {', '.join(strangers[:3])}, which this "
            "checkpoint does not write; it is never replaced, even with --force: choose "
            "another -o"
        )


def _stored_items(items: list[StateDictItem], stored: list[str]) -> list[StateDictItem]:
    """The items of one weights file, each under the name the source stored it by
    (a tied tensor may have been stored under any of its names)."""
    by_name = {n: it for it in items for n in (it.slot.name, *it.aliases)}
    out = []
    for name in stored:
        it = by_name[name]
        slot = dataclasses.replace(it.slot, name=name)
        out.append(StateDictItem(slot, (), it.ranges))
    return out


def _write_weights(ckpt: FlatCheckpoint, path: Path, items, progress, copier: Copier) -> None:
    """One safetensors file with the source's metadata and no tie records: the
    Trainer's file stored each tied tensor once and recorded nothing else."""
    names = {n for it in items for n in (it.slot.name, *it.aliases)}
    meta = {
        k: v for k, v in ckpt.source_metadata.items() if k not in names and k not in YAFSDP_KEYS
    }
    write_safetensors(path, items, meta, progress, copier)


def _write_optimizer(ckpt: FlatCheckpoint, items: list, path: Path) -> None:
    """``optimizer.pt``: the state dict rebuilt from the state buffers and the record."""
    values = {
        path: read_tensor(it)
        for path, it in training_items(ckpt, items).items()
        if path[0] == OPTIMIZER_FILE
    }
    values.update(extras_of(ckpt.optim))
    osd = nest(values)[OPTIMIZER_FILE]
    state = osd.pop("state", {})
    # torch's order: parameters by number, ``step`` before the state tensors; with the
    # same name (the archive's) torch.save then writes the Trainer's bytes again
    osd = {"state": {pid: _step_first(state[pid]) for pid in sorted(state)}, **osd}
    torch_save(_shared_keys(osd), path, by_name=True)


def _step_first(fields: dict) -> dict:
    return dict(sorted(fields.items(), key=lambda kv: kv[0] != "step"))


def _shared_keys(node):
    """Equal string keys as one object, as in an optimizer's own state dict (every
    group's keys come from its defaults, every parameter's from one loop), so that
    pickle refers back to them as it did in the source."""
    if isinstance(node, dict):
        return {
            sys.intern(k) if isinstance(k, str) else k: _shared_keys(v) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_shared_keys(v) for v in node]
    return node
