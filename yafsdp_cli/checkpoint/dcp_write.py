"""A torch.distributed.checkpoint folder, written without torch.

What ``dcp.save(state, storage_writer=FileSystemWriter(folder,
single_file_per_rank=False))`` writes in one process, byte for byte in structure:

- the state is flattened as DCP flattens it (``_traverse.traverse_state_dict``:
  dicts always, lists only where they hold a tensor or a dict, each key ``str``-ed;
  fqn = the path joined by dots), and each leaf becomes one item, in that order;
- item ``k`` is the file ``__0_{k}.distcp``, one ``torch.save`` archive at offset 0
  (``sources.torch_archive``/``torch_pickle``): a tensor as ``_rebuild_tensor_v2``
  of one storage member whose bytes are copied by the kernel straight from the flat
  checkpoint (``file_ranges.Copier``, CRC-32 read back for the data descriptor and the
  ledger); any other value pickled as it is (protocol 2, as ``torch.save``);
- ``.metadata``: DCP's ``Metadata`` of stand-ins (``sources.dcp_pickle``) pickled
  under torch's class names: each tensor's properties, size and one chunk, each
  value a ``BytesStorageMetadata``, the planner's key paths, every item's file and
  byte range, a ``StorageMeta`` and version ``1.0.0``.

Importing torch would cost more than copying a checkpoint of a few GiB
(``python -m benchmarks.run convert_optim``), and no tensor is ever held in memory:
a file's bytes move from the flat file to the archive by range.
``tests/dcp/test_dcp_write.py`` checks the result against torch's own ``dcp.save`` of
the same state (archives equal but for their random ids, metadata equal) and loads
it with ``dcp.load`` and ``FileSystemReader().read_metadata()``.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..sources import dcp_pickle as dp
from ..sources.torch_archive import (
    BYTEORDER,
    FORMAT_VERSION,
    SERIALIZATION_ID,
    STORAGE_ALIGNMENT,
    VERSION,
    ArchiveWriter,
    serialization_id,
    torch_members,
)
from ..sources.torch_pickle import Dtype, RawTensor, tensor_pickle
from .crc import crc32, crc32_combine
from .file_ranges import Copier, FileRange, coalesce, write_at
from .reader import StateDictItem
from .results import Progress

DCP_VERSION = "1.0.0"  # torch's CURRENT_DCP_VERSION
METADATA_NAME = ".metadata"


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (StateDictItem, RawTensor))


def _is_terminal(value: Any) -> bool:
    """As DCP's ``traverse_state_dict``: a dict is never a leaf; a list is one unless
    it holds a tensor or a non-leaf list or dict; anything else is."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (dict, list)) and not _is_terminal(entry):
            return False
        if _is_tensor(entry):
            return False
    return True


def flatten(state: dict) -> list[tuple[str, tuple, Any]]:
    """``(fqn, key path, leaf)`` of every leaf, in DCP's order."""
    out: list[tuple[str, tuple, Any]] = []
    seen: set[str] = set()

    def visit(path: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit((*path, str(k)), v)
        elif _is_terminal(value):
            fqn = ".".join(map(str, path))
            if fqn in seen:
                raise CheckpointError(f"two entries of the checkpoint flatten to {fqn!r}")
            seen.add(fqn)
            out.append((fqn, path, value))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit((*path, i), v)

    for key, value in state.items():
        visit((str(key),), value)
    return out


class _MemberCrc:
    """The CRC-32 of a member copied in pieces (``Copier.copy``'s digest)."""

    def __init__(self):
        self.crc = 0

    def extend(self, piece: int, n: int) -> None:
        self.crc = crc32_combine(self.crc, piece, n)


@dataclass
class _Writing:
    folder: Path
    copier: Copier
    progress: Progress | None
    total: int
    done: int = 0

    def tick(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress("writing", self.done, self.total)


def write_dcp(
    folder: Path,
    state: dict,
    copier: Copier,
    *,
    checkpoint_id: Path,
    progress: Progress | None = None,
) -> None:
    """Write ``state`` (nested dicts and lists whose tensors are ``StateDictItem``s
    read from a flat checkpoint, or ``RawTensor``s) into the empty ``folder`` as DCP
    does (module note); ``checkpoint_id`` is recorded as the folder's name."""
    items = flatten(state)
    total = sum(it.slot.nbytes for _, _, it in items if isinstance(it, StateDictItem))
    w = _Writing(folder, copier, progress, total)
    sd_md, planner, storage = {}, {}, {}
    for k, (fqn, path, leaf) in enumerate(items):
        name = f"__0_{k}.distcp"
        length = _write_item(w, folder / name, leaf)
        planner[fqn] = path
        if _is_tensor(leaf):
            dtype, shape = _spec(leaf)
            zeros = dp.Size((0,) * len(shape))
            sd_md[fqn] = dp.TensorStorageMetadata(
                properties=dp.TensorProperties(Dtype.named(dtype)),
                size=dp.Size(shape),
                chunks=[dp.ChunkStorageMetadata(offsets=zeros, sizes=dp.Size(shape))],
            )
            index = dp.MetadataIndex(fqn=fqn, index=0, offset=zeros)
        else:
            sd_md[fqn] = dp.BytesStorageMetadata()
            index = dp.MetadataIndex(fqn=fqn, index=None, offset=None)
        storage[index] = dp._StorageInfo(relative_path=name, offset=0, length=length)
    meta = dp.StorageMeta(
        checkpoint_id=checkpoint_id, save_id=str(uuid.uuid4()), load_id=None, modules=[]
    )
    md = dp.Metadata(
        state_dict_metadata=sd_md,
        planner_data=planner,
        storage_data=storage,
        storage_meta=meta,
        version=DCP_VERSION,
    )
    with open(folder / METADATA_NAME, "xb") as f:
        dp.dump_metadata(md, f)


def _spec(leaf) -> tuple[str, tuple[int, ...]]:
    if isinstance(leaf, StateDictItem):
        return leaf.slot.dtype, tuple(leaf.slot.shape)
    return leaf.dtype, tuple(leaf.shape)


def _raw_tensors(value: Any) -> list[RawTensor]:
    """Each ``RawTensor`` in ``value``, in pickling order (torch numbers storages so)."""
    out: dict[int, RawTensor] = {}

    def walk(v):
        if isinstance(v, RawTensor):
            out.setdefault(id(v), v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)

    walk(value)
    return list(out.values())


def _write_item(w: _Writing, path: Path, leaf: Any) -> int:
    """One item's archive; returns its length."""
    if isinstance(leaf, StateDictItem):
        spec = {id(leaf): (leaf.slot.dtype, tuple(leaf.slot.shape))}
        pickled = tensor_pickle(leaf, spec)
        return _archive(w, path, pickled, [leaf])
    tensors = _raw_tensors(leaf)
    specs = {id(t): (t.dtype, tuple(t.shape)) for t in tensors}
    return _archive(w, path, tensor_pickle(leaf, specs), tensors)


def _nbytes(t) -> int:
    if isinstance(t, StateDictItem):
        return t.slot.nbytes
    return len(t.data)


def _archive(w: _Writing, path: Path, pickled: bytes, tensors: list) -> int:
    sizes = [(str(k), _nbytes(t)) for k, t in enumerate(tensors)]
    arch = ArchiveWriter(torch_members(sizes, len(pickled)))
    small = {
        "data.pkl": pickled,
        ".format_version": FORMAT_VERSION,
        ".storage_alignment": STORAGE_ALIGNMENT,
        "byteorder": BYTEORDER,
        "version": VERSION,
    }
    # an OSError (disk full) reaches ``writer.staged_output``, which names the output
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, arch.nbytes)  # data not written (holes of a sparse input) reads as 0
        for offset, data in arch.headers():
            write_at(fd, data, offset, path)
        for name, data in small.items():
            write_at(fd, data, arch.data_at(name), path)
        found = {name: crc32(data) for name, data in small.items()}
        for k, t in enumerate(tensors):
            found[f"data/{k}"] = _tensor_data(w, fd, arch.data_at(f"data/{k}"), t, path)
        crcs = {name: found[name] for name in arch.records}  # in write order
        ident = serialization_id(crcs, arch.sizes)
        write_at(fd, ident, arch.data_at(SERIALIZATION_ID), path)
        crcs[SERIALIZATION_ID] = crc32(ident)
        for offset, data in arch.trailer(crcs):
            write_at(fd, data, offset, path)
    finally:
        os.close(fd)
    return arch.nbytes


def _tensor_data(w: _Writing, fd: int, at: int, t, path: Path) -> int:
    """A tensor's bytes into ``[at, at + nbytes)``; their CRC-32."""
    if isinstance(t, RawTensor):
        write_at(fd, t.data, at, path)
        return crc32(t.data)
    digest, pos = _MemberCrc(), at
    for piece in coalesce(t.ranges()):
        if not isinstance(piece, FileRange):  # ranges() gives file ranges only
            raise CheckpointError(f"{t.slot.name}: a piece with no file behind it")
        w.copier.copy(piece, fd, pos, digest, w.tick)
        pos += piece.nbytes
    if pos - at != t.slot.nbytes:
        raise CheckpointError(
            f"{t.slot.name}: read {pos - at} bytes, the layout says {t.slot.nbytes}"
        )
    return digest.crc
