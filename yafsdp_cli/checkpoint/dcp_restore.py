"""``restore --format dcp``: a flat checkpoint as a torch.distributed.checkpoint folder.

The folder is written by torch's own ``dcp.save`` with a ``FileSystemWriter``, in one
process (``no_dist``): ``.metadata`` and one ``__0_K.distcp`` file per tensor, so
``dcp.load(model.state_dict(), checkpoint_id=OUT)`` (or FSDP2's
``get_model_state_dict``/``set_model_state_dict`` on any number of ranks) reads it.
``dcp.save`` is handed the state dict as meta tensors (names, shapes, dtypes: all its
planner needs) and a planner whose ``resolve_data`` reads a tensor's bytes from the
flat checkpoint only when torch's writer asks for it; with one file per tensor (torch's
writer keeps a file's tensors until the file is done) one tensor is in memory at a
time. Every name is written, tied names included (each its own copy, as a plain
``model.state_dict()`` saves them), so every key a model asks for is there.

Same safety as the other outputs: the flat input is verified first (checksums, zero
padding), the folder is staged beside the target and renamed at the end, an existing
output needs ``--force``, and a folder that is not a DCP checkpoint is never replaced.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from ..engine import dtypes
from ..errors import CheckpointError
from .reader import FlatCheckpoint
from .results import Progress, RestoreResult, restored
from .writer import existing_folder_output, staged_output

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
    """Write ``items`` (``restore.state_dict_items(ckpt)``) as a DCP folder ``out``,
    after verifying every checksum and the zero padding of ``ckpt``."""
    check_dcp_name(out)
    check_dcp_output(out, inputs=list(ckpt.paths), force=force)
    checked = ckpt.verify(progress)
    by_name = {name: it for it in items for name in (it.slot.name, *it.aliases)}
    with staged_output(out, folder=True) as staged:
        write_dcp(staged.temp, by_name, progress)
        nbytes = sum(p.stat().st_size for p in staged.temp.iterdir())
    # nothing is dropped: tied names are each written
    return restored(ckpt, out, nbytes=nbytes, checked=checked, fmt="dcp", tensors=len(by_name))


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


def write_dcp(
    folder: Path, items: dict, progress: Progress | None = None, state: dict | None = None
) -> None:
    """``dcp.save`` of ``items`` (name -> ``reader.StateDictItem``: slot and byte source) into
    the empty ``folder``. ``state`` is the (nested) state dict to save when it is more
    than ``items``: meta tensors where ``items`` has the flattened key, plain values
    (step counts, param groups) saved as they are."""
    import torch
    import torch.distributed.checkpoint as dcp

    if state is None:
        state = {
            name: torch.empty(it.slot.shape, dtype=dtypes.to_torch(it.slot.dtype), device="meta")
            for name, it in items.items()
        }
    from torch.distributed.checkpoint.api import CheckpointException

    from ..sources.dcp_folder import cause

    planner = _planner(items, progress)
    # One file per tensor: torch's writer keeps every tensor of a file until that
    # file is written, so one file for all would hold the whole model. No fsync per
    # file: the folder is renamed into place once complete, like every other output.
    writer = dcp.FileSystemWriter(
        folder, single_file_per_rank=False, sync_files=False, thread_count=1
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as exc:  # a BaseException that wraps ours
        inner = next(iter(exc.failures.values()), (None,))[0]
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"writing the DCP checkpoint failed ({cause(exc)})") from None


def _planner(items: dict, progress: Progress | None):
    """A ``DefaultSavePlanner`` that reads each tensor when the writer resolves it."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    total = sum(it.slot.nbytes for it in items.values())

    class _StreamingPlanner(DefaultSavePlanner):
        done = 0

        def resolve_data(self, write_item):
            item = items.get(write_item.index.fqn)
            if item is None:  # a plain value of the state dict
                return super().resolve_data(write_item)
            tensor = read_tensor(item)
            self.done += item.slot.nbytes
            if progress is not None:
                progress("writing", self.done, total)
            return tensor

    return _StreamingPlanner()


def read_tensor(item):
    """One state-dict tensor from its byte source (a new tensor)."""
    import torch

    slot = item.slot
    dtype = dtypes.to_torch(slot.dtype)
    if not slot.nbytes:
        return torch.empty(slot.shape, dtype=dtype)
    data = bytearray(slot.nbytes)
    pos = 0
    for chunk in item.read():
        data[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    if pos != slot.nbytes:
        raise CheckpointError(f"{slot.name}: read {pos} bytes, the layout says {slot.nbytes}")
    return torch.frombuffer(data, dtype=dtype).reshape(slot.shape)
