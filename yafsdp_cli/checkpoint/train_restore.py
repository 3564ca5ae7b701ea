"""``restore`` of a checkpoint with optimizer state: the source's own nesting back.

The optimizer record (``optim_state.py``) keeps the key path of the weights, of every
state tensor and of every other value, so the output is the source's structure: a
DCP folder with the same top-level entries and namespaces (``model.…``,
``optimizer.state.…``, ``optimizer.param_groups.…``, ``train_state.…``), which
``dcp.load({"model": sd, "optimizer": osd}, ...)`` reads as it read the input; or a
``torch.save`` dict with the same nesting. Weights and state tensors are read from the
flat buffers by byte ranges (the state of an entry lies at the entry's own offsets in
its state buffer), bit for bit what the source held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import dtypes
from ..errors import CheckpointError
from ..sources.state import IntKey
from .format import TensorSlot
from .optim_state import SEP, OptimState, decode, path_of
from .reader import FlatCheckpoint, StateDictItem
from .results import Progress, RestoreResult, restored

FORMS = {"dcp": "dcp", "pt": "pt", "trainer": "trainer"}  # record form -> restore --format


def check_form(optim: OptimState, fmt: str) -> None:
    want = FORMS.get(optim.form)
    if want != fmt:
        raise CheckpointError(
            f"this checkpoint carries optimizer state from a {optim.form} checkpoint, which "
            f"is restored as --format {want}; pass --weights-only for the weights alone "
            f"as {fmt}"
        )


def fqn_of(path) -> str:
    """The flattened key ``dcp.save`` gives a value at ``path``."""
    return ".".join(str(p) for p in path)


def training_items(ckpt: FlatCheckpoint, items: list) -> dict[str, Any]:
    """key path -> item (``StateDictItem``) for weights (every name) and state tensors."""
    optim = ckpt.optim
    out: dict[tuple, Any] = {}
    for it in items:
        for name in (it.slot.name, *it.aliases):
            out[(*optim.model_path, name)] = it
    state_buffers = {b.name: b for b in optim.state_buffers(ckpt.layout)}
    for b in ckpt.layout.buffers:
        for e in b.entries:
            for field, path in optim.paths.get(e.name, {}).items():
                sb = state_buffers[f"{b.name}{SEP}{field}"]
                isz = dtypes.itemsize(sb.dtype)

                def ranges(sb=sb, start=e.offset * isz, stop=(e.offset + e.numel) * isz):
                    return ckpt.ranges(sb, start, stop)

                slot = TensorSlot(fqn_of(path), sb.dtype, e.shape)
                out[path_of(path)] = StateDictItem(slot, (), ranges)
    return out


class _ListNode(dict):
    """A list under construction: index -> value."""


def nest(values: dict[tuple, Any]) -> dict:
    """The nested dict (lists where a path step is an int) holding each value."""
    root: dict = {}
    for path, value in values.items():
        node = root
        for step, nxt in zip(path, path[1:]):
            if step not in node:
                is_index = isinstance(nxt, int) and not isinstance(nxt, IntKey)
                node[step] = _ListNode() if is_index else {}
            node = node[step]
        node[path[-1]] = value
    return _finish(root)


def _finish(node):
    if isinstance(node, _ListNode):
        if sorted(node) != list(range(len(node))):
            raise CheckpointError(f"list indices {sorted(node)} are not 0..{len(node) - 1}")
        return [_finish(node[i]) for i in range(len(node))]
    if isinstance(node, dict):  # an IntKey is written as the plain int it stands for
        return {int(k) if isinstance(k, IntKey) else k: _finish(v) for k, v in node.items()}
    return node


def extras_of(optim: OptimState, *, raw: bool = False) -> dict[tuple, Any]:
    """Every other value of the record under its key path (tensors as torch tensors,
    or with ``raw`` as ``RawTensor``)."""
    return {path_of(path): decode(value, raw=raw) for path, value in optim.extras}


def restore_training(
    ckpt: FlatCheckpoint,
    out: Path,
    fmt: str,
    items: list,
    *,
    force: bool,
    progress: Progress | None,
) -> RestoreResult:
    """Write the training checkpoint ``ckpt`` back in its source's layout at ``out``."""
    check_form(ckpt.optim, fmt)
    tensors = training_items(ckpt, items)
    if fmt == "dcp":
        nbytes, checked = _write_dcp(ckpt, out, tensors, force=force, progress=progress)
    else:
        nbytes, checked = _write_pt(ckpt, out, tensors, force=force, progress=progress)
    return restored(ckpt, out, nbytes=nbytes, checked=checked, fmt=fmt, tensors=len(tensors))


def _write_dcp(ckpt, out: Path, tensors: dict, *, force: bool, progress) -> tuple[int, int]:
    from .dcp_restore import check_dcp_name, check_dcp_output, write_checked

    check_dcp_name(out)
    check_dcp_output(out, inputs=list(ckpt.paths), force=force)
    values = dict(tensors)
    values.update(extras_of(ckpt.optim, raw=True))
    return write_checked(ckpt, out, nest(values), progress, force=force)


def _write_pt(ckpt, out: Path, tensors: dict, *, force: bool, progress) -> tuple[int, int]:

    from .writer import check_output, staged_output, torch_save

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
