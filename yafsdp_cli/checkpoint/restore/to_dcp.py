"""``restore --format dcp``: a flat checkpoint as a torch.distributed.checkpoint folder.

The folder is what torch's own ``dcp.save`` writes in one process with a
``FileSystemWriter`` of one file per item: ``.metadata`` and one ``__0_K.distcp``
file per tensor, so ``dcp.load(model.state_dict(), checkpoint_id=OUT)`` (or FSDP2's
``get_model_state_dict``/``set_model_state_dict`` on any number of ranks) reads it.
It is written without torch (``dcp_write.py``), each tensor's bytes copied by range
from the flat checkpoint, so no tensor is ever in memory. Every name is written,
tied names included (each its own copy, as a plain ``model.state_dict()`` saves
them), so every key a model asks for is there. A checkpoint with optimizer state from
a DCP source is written in that source's nesting instead (``write_training_dcp``):
the same top-level entries and namespaces (``model.…``, ``optimizer.state.…``,
``optimizer.param_groups.…``, ``train_state.…``), which
``dcp.load({"model": sd, "optimizer": osd}, ...)`` reads as it read the input.

Same safety as the other outputs: the flat input is verified (checksums, zero
padding) in the same pass as the copy, and the folder is staged beside the target
and renamed at the end only when it all checks out; an existing output needs
``--force``, and a folder that is not a DCP checkpoint is never replaced.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import CheckpointError
from ..dcp_write import write_dcp
from ..file_ranges import Copier
from ..reader import FlatCheckpoint
from ..results import Progress, RestoreResult, restored
from ..writer import existing_folder_output, staged_output
from .read_back import extras_of, nest

METADATA_NAME = ".metadata"
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


def restore_dcp(
    ckpt: FlatCheckpoint,
    out: Path,
    items: list,
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> RestoreResult:
    """Write ``items`` (``read_back.state_dict_items(ckpt)``) as a DCP folder ``out``;
    every checksum and the zero padding of ``ckpt`` are verified before it appears."""
    check_dcp_name(out)
    check_dcp_output(out, inputs=list(ckpt.paths), force=force)
    state = {name: it for it in items for name in (it.slot.name, *it.aliases)}
    nbytes, checked = write_checked(ckpt, out, state, progress, force=force)
    # nothing is dropped: tied names are each written
    return restored(ckpt, out, nbytes=nbytes, checked=checked, fmt="dcp", tensors=len(state))


def write_training_dcp(
    ckpt: FlatCheckpoint, out: Path, tensors: dict, *, force: bool, progress: Progress | None
) -> tuple[int, int]:
    """The training checkpoint ``ckpt`` as a DCP folder in its source's nesting:
    ``tensors`` (``read_back.training_items``) and the record's other values, each
    under its key path. Returns (bytes written, tensors checked)."""
    check_dcp_name(out)
    check_dcp_output(out, inputs=list(ckpt.paths), force=force)
    values = dict(tensors)
    values.update(extras_of(ckpt.optim, raw=True))
    return write_checked(ckpt, out, nest(values), progress, force=force)


def write_checked(
    ckpt: FlatCheckpoint, out: Path, state: dict, progress: Progress | None, *, force: bool
) -> tuple[int, int]:
    """``state`` written as a DCP folder staged beside ``out`` (``dcp_write``), then
    ``ckpt`` verified, reading only what the copy did not (padding, replicas); renamed
    into place when both succeed. Returns (bytes written, tensors checked)."""
    copier = Copier(record=True)
    with staged_output(out, folder=True, force=force) as staged:
        write_dcp(staged.temp, state, copier, checkpoint_id=out, progress=progress)
        checked = ckpt.verify(progress, copier)
        nbytes = sum(p.stat().st_size for p in staged.temp.iterdir())
    return nbytes, checked


def check_dcp_name(out: Path) -> None:
    if out.name.endswith((".safetensors", ".pt", ".pth", ".bin")):
        raise CheckpointError(
            f"output {out}: --format dcp writes a folder (.metadata and .distcp files); "
            "give a folder name without a file suffix"
        )


def check_dcp_output(out: Path, *, inputs: list[Path], force: bool) -> None:
    """Refuse an output that is (or holds) an input, that exists without ``--force``,
    or that is anything but a DCP checkpoint folder (never replaced, even forced)."""
    names = existing_folder_output(out, inputs=inputs, force=force, kind="a DCP checkpoint")
    if names is None:
        return
    strangers = [n for n in names if n != METADATA_NAME and not _DATA_FILE.fullmatch(n)]
    if strangers or (names and METADATA_NAME not in names):
        raise CheckpointError(
            f"output {out} is a folder that is not a DCP checkpoint (it holds "
            f"{', '.join(sorted(strangers)[:3]) or 'no .metadata'}); it is never replaced, "
            "even with --force: choose another -o"
        )
