"""A flat checkpoint read back: named tensors, and a training checkpoint's key paths.

What every restore output is written from, whatever its format:

- ``state_dict_items``: every entry of every buffer (flat order) and every stored kept
  tensor as a ``StateDictItem``: its name, dtype, shape and tied names, and its bytes
  as ranges of the flat files (an entry's slice lies at its own offsets in its
  buffer), so each tensor is bit for bit what the source held and none is in memory;
- ``training_items``: with optimizer state (``optim_state.py``), the same weights
  under the source's key path (``model.…``) plus every state tensor under its own
  (the state of an entry lies at the entry's offsets in its state buffer);
  ``extras_of`` gives the record's other values (step counts, param groups, a
  scheduler's entries) under theirs, and ``nest`` builds the source's own nesting
  from key paths;
- ``read_tensor``: one item as a torch tensor, for the outputs that ``torch.save``.

The optimizer-state record (``optim_state.py``) is imported by the functions that use
it: a weights-only restore does not load it (``tests/cli/test_cli_entry.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...engine import dtypes
from ...errors import CheckpointError
from ...sources.state import IntKey
from ..flat_writer import stored_kept
from ..format import TensorSlot
from ..reader import FlatCheckpoint, StateDictItem

if TYPE_CHECKING:
    from ..optim_state import OptimState


def state_dict_items(ckpt: FlatCheckpoint) -> list[StateDictItem]:
    """Entries (flat order) and stored kept tensors, each with its byte source."""
    items = []
    for b in ckpt.layout.buffers:
        isz = dtypes.itemsize(b.dtype)
        for e in b.entries:
            start, stop = e.offset * isz, (e.offset + e.numel) * isz

            def ranges(b=b, start=start, stop=stop):
                return ckpt.ranges(b, start, stop)

            items.append(StateDictItem(TensorSlot(e.name, e.dtype, e.shape), e.aliases, ranges))
    for t in stored_kept(ckpt.layout):
        slot = TensorSlot(t.name, t.dtype, t.shape)
        items.append(StateDictItem(slot, t.aliases, lambda n=t.name: [ckpt.kept_range(n)]))
    return items


def fqn_of(path) -> str:
    """The flattened key ``dcp.save`` gives a value at ``path``."""
    return ".".join(str(p) for p in path)


def training_items(ckpt: FlatCheckpoint, items: list) -> dict[str, Any]:
    """key path -> item (``StateDictItem``) for weights (every name) and state tensors."""
    from ..optim_state import SEP, path_of

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
    from ..optim_state import decode, path_of

    return {path_of(path): decode(value, raw=raw) for path, value in optim.extras}


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
