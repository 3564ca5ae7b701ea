"""PyTorch Distributed Checkpoint (DCP) folders: what FSDP2 and torchtitan save.

A DCP folder holds ``.metadata`` and one ``__R_K.distcp`` file per saving rank (each
chunk a ``torch.save``d shard). Names, shapes and dtypes come from the metadata alone
(read safely, see ``dcp_meta``). Tensor bytes are found without torch
(``dcp_data``): each chunk's bytes are a byte range of its ``.distcp`` file, which
``convert`` copies file to file as it copies a safetensors source, so reading a DCP
folder never imports torch (over a second, more than copying a few GiB). A tensor
whose chunks are laid out otherwise is read with torch's own ``FileSystemReader``
and ``dcp.load(..., no_dist=True)`` into a plain tensor of the whole shape, one
tensor at a time, so no process group is needed and the model is never held in
memory.

A training checkpoint holds more than weights. ``dcp.save`` flattens a nested state
dict into dotted keys and records each key's path: torchtitan and FSDP2 recipes save
``{"model": ..., "optimizer": ..., "lr_scheduler": ..., "train_state": ...}`` (keys
``model.layers.0.attention.wq.weight``, ``optimizer.state.layers.0.attention.wq.weight
.exp_avg``), and newer torchtitan puts the model's keys at the top level. The weights
are the ``model`` entry (or ``state_dict``, ``model_state_dict``, ``module``,
``weights``) when there is one, with that prefix dropped, else every top-level tensor;
optimizer state (the ``optimizer`` entry) is described, never loaded.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine import dtypes
from ..errors import SourceError, cut
from ..fileio import CHUNK_BYTES, read_chunks
from .dcp_data import ChunkBytes, tensor_pieces
from .dcp_meta import METADATA_NAME, DcpMetadata, DcpTensor, read_dcp_metadata
from .torch_archive import check_crc

if TYPE_CHECKING:
    import torch
from .state import CheckpointState, StateGroup

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "weights")
OPTIMIZER_KEYS = ("optimizer", "optim", "optimizers", "optimizer_state_dict")
# Top-level entries of trainers' checkpoints; used only when the metadata has no key paths.
TRAINER_KEYS = ("lr_scheduler", "lr_schedulers", "scheduler", "dataloader", "train_state", "rng")


@dataclass(frozen=True, slots=True)
class DcpWeights:
    """A DCP checkpoint opened for its weights (``files.load_file`` makes the spec)."""

    reader: DcpReader
    state: CheckpointState
    notes: tuple[str, ...]


def open_dcp(folder: Path) -> DcpWeights:
    """The weights of DCP folder ``folder`` and a description of everything else."""
    md = read_dcp_metadata(folder)
    split = _split(md)
    if not split.model:
        tops = _some(sorted({_top(md, f)[0] for f in md.tensors})) or "none"
        raise SourceError(
            f"{folder}: a DCP checkpoint with no model weights (its tensor entries: {tops})"
        )
    state = _describe(md, split)
    return DcpWeights(DcpReader(md, split.model), state, tuple(_notes(state, split.key)))


def _some(names, shown: int = 8) -> str:
    """Names from the file for a message: the first few, each bounded and escaped."""
    out = ", ".join(cut(n, 80) for n in names[:shown])
    return out + (f" and {len(names) - shown} more" if len(names) > shown else "")


@dataclass(frozen=True, slots=True)
class _Split:
    key: str | None  # the model entry, if nested
    model: dict[str, str]  # weight name -> fqn
    optimizer: tuple[str, ...]  # fqns
    other: dict[str, tuple[str, ...]]  # top-level entry -> fqns


def _top(md: DcpMetadata, fqn: str) -> tuple[str, bool]:
    """The top-level entry of ``fqn`` and whether it is nested under it."""
    path = md.paths.get(fqn)
    if path is not None:
        return str(path[0]), len(path) > 1
    head, dot, _ = fqn.partition(".")  # no key paths: only known entries count as nested
    if dot and head in (*OPTIMIZER_KEYS, *TRAINER_KEYS):
        return head, True
    return fqn, False


def _split(md: DcpMetadata) -> _Split:
    tops = {f: _top(md, f) for f in md.tensors}
    nested = {t for t, is_nested in tops.values() if is_nested}
    key = next((k for k in MODEL_KEYS if k in nested), None)
    model, optimizer, other = {}, [], {}
    for fqn, (top, is_nested) in tops.items():
        if (key is not None and top == key) or (key is None and not is_nested):
            model[fqn[len(key) + 1 :] if key else fqn] = fqn
        elif top in OPTIMIZER_KEYS:
            optimizer.append(fqn)
        else:
            other.setdefault(top, []).append(fqn)
    return _Split(key, model, tuple(optimizer), {k: tuple(v) for k, v in other.items()})


def _describe(md: DcpMetadata, split: _Split) -> CheckpointState:
    by_state: dict[str, list[DcpTensor]] = {}
    params = set()
    for fqn in split.optimizer:
        rest = fqn.split(".", 1)[1] if "." in fqn else fqn
        if rest.startswith("state.") and "." in rest[6:]:
            param, _, name = rest[6:].rpartition(".")
            params.add(param)
        else:
            name = "other optimizer tensors"
        by_state.setdefault(name, []).append(md.tensors[fqn])
    groups = tuple(_group(n, ts) for n, ts in by_state.items())
    other = tuple(_group(k, [md.tensors[f] for f in fs]) for k, fs in split.other.items())
    model = [md.tensors[f] for f in split.model.values()]
    floating = [n for n, f in split.model.items() if dtypes.is_floating(md.tensors[f].dtype)]
    # optimizer state is keyed by parameter name; names that match none (raw
    # ``optimizer.state_dict()`` numbers its parameters) tell nothing
    known = params & set(floating)
    return CheckpointState(
        format="dcp",
        model_key=split.key,
        files=len(md.files),
        model_tensors=len(model),
        model_bytes=sum(t.nbytes for t in model),
        optimizer_kind=_optimizer_kind(set(by_state)),
        optimizer_params=len(params),
        without_state=tuple(n for n in floating if n not in params) if known else (),
        optimizer=groups,
        optimizer_bytes=sum(g.bytes for g in groups),
        other=other,
        non_tensor_items=len(md.non_tensors),
    )


def _group(name: str, tensors: list[DcpTensor]) -> StateGroup:
    return StateGroup(
        name=name,
        tensors=len(tensors),
        numel=sum(t.numel for t in tensors),
        bytes=sum(t.nbytes for t in tensors),
        dtypes=tuple(dict.fromkeys(t.dtype for t in tensors)),
    )


def _optimizer_kind(states: set[str]) -> str | None:
    """Adam and AdamW keep the same states (which one it was is in the param groups,
    pickled values we do not load); SGD with momentum keeps one."""
    if {"exp_avg", "exp_avg_sq"} <= states:
        return "adamw"
    if "momentum_buffer" in states:
        return "sgd"
    return None


def _notes(state: CheckpointState, key: str | None) -> list[str]:
    where = f"the checkpoint's {key!r} entry" if key else "the checkpoint's top-level tensors"
    notes = [f"DCP checkpoint saved in {state.files} data file(s); weights from {where}"]
    if state.optimizer:
        names = _some([g.name for g in state.optimizer])
        kind = state.optimizer_kind or "unrecognised"
        notes.append(
            f"it also holds {kind} optimizer state ({names}) for {state.optimizer_params} "
            "parameters; convert carries it as state buffers (--weights-only leaves it out)"
        )
    if state.other:
        notes.append(f"other entries, not read: {_some([g.name for g in state.other])}")
    return notes


class DcpReader:
    """The weights of a DCP checkpoint, tensor by tensor: as byte ranges of the
    ``.distcp`` files where ``dcp_data`` finds them, else through torch's reader."""

    def __init__(self, md: DcpMetadata, fqns: dict[str, str]):
        self.md = md
        self.fqns = fqns  # weight name -> fqn
        self._storage = None
        self._pieces: dict[str, list[ChunkBytes] | None] = {}
        self.handed: list[ChunkBytes] = []  # pieces given out as file ranges, to check

    def names(self) -> list[str]:
        return list(self.fqns)

    def tensor_meta(self, name: str) -> DcpTensor:
        return self.md.tensors[self.fqns[name]]

    def nbytes(self, name: str) -> int:
        return self.tensor_meta(name).nbytes

    def dtype(self, name: str) -> str:
        return self.tensor_meta(name).dtype

    def pieces(self, name: str) -> list[ChunkBytes] | None:
        """Where the tensor's bytes lie, in order, or None when torch must read it."""
        fqn = self.fqns[name]
        if fqn not in self._pieces:
            self._pieces[fqn] = tensor_pieces(self.md, fqn)
        return self._pieces[fqn]

    def file_ranges(self, name: str) -> list[tuple[Path, int, int]] | None:
        """``(path, offset, nbytes)`` of the tensor's bytes, for a copy; whoever copies
        them checks each piece's member afterwards (``check_copied``)."""
        pieces = self.pieces(name)
        if pieces is None:
            return None
        self.handed.extend(pieces)
        return [(p.path, p.offset, p.nbytes) for p in pieces]

    def files(self) -> list[Path]:
        return [self.md.folder / METADATA_NAME, *self.md.files]

    def check_copied(self, crc_of) -> None:
        """Every piece handed out as a range matches its member's stored CRC-32;
        ``crc_of(path, offset, nbytes)`` gives the CRC of a range (read back by the
        copier, so nothing is read twice)."""
        seen = set()
        for p in self.handed:
            m = p.member
            if m.crc and (p.path, m.offset) not in seen:
                seen.add((p.path, m.offset))
                check_crc(m, crc_of(p.path, m.offset, m.nbytes), f"{p.path} at byte {m.offset}")

    def load(self, name: str) -> torch.Tensor:
        """The whole tensor, assembled from its chunks (a new tensor; the metadata
        check made sure the chunks cover every element)."""
        import torch

        meta = self.tensor_meta(name)
        dtype = dtypes.to_torch(meta.dtype)
        if self.pieces(name) is not None:
            if not meta.nbytes:
                return torch.empty(meta.shape, dtype=dtype)
            data, pos = bytearray(meta.nbytes), 0
            for part in self.iter_bytes(name):
                data[pos : pos + len(part)] = part
                pos += len(part)
            return torch.frombuffer(data, dtype=dtype).reshape(meta.shape)
        out = torch.empty(meta.shape, dtype=dtype)
        load_into({meta.fqn: out}, self._reader(), self.md.folder)
        return out

    def iter_bytes(self, name: str, chunk: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The tensor's bytes, each chunk valid until the next (as for safetensors):
        read from their ranges and checked against their members' CRC-32, or, where
        torch must read the tensor, views of it with the last chunk a copy (a caller
        holding that chunk must not keep the whole tensor alive while the next loads)."""
        pieces = self.pieces(name)
        if pieces is not None:
            for p in pieces:
                yield from _checked_piece(p, chunk)
            return
        from .torch_file import TensorDictReader

        pieces = TensorDictReader({name: self.load(name)}).iter_bytes(name, chunk)
        last = next(pieces, None)
        for piece in pieces:
            yield last
            last = piece
        if last is not None:
            yield memoryview(bytes(last))

    def _reader(self):
        if self._storage is None:
            self._storage = _storage_reader(self.md)
        return self._storage


def _checked_piece(p: ChunkBytes, chunk: int) -> Iterator[memoryview]:
    """A piece's bytes; the rest of its member is read too, for the CRC-32."""
    m = p.member
    crc = 0
    for part in read_chunks(p.path, m.offset, p.offset - m.offset):
        crc = zlib.crc32(part, crc)
    for part in read_chunks(p.path, p.offset, p.nbytes, chunk):
        crc = zlib.crc32(part, crc)
        yield part
    end = p.offset + p.nbytes
    for part in read_chunks(p.path, end, m.offset + m.nbytes - end):
        crc = zlib.crc32(part, crc)
    check_crc(m, crc, f"{p.path} at byte {m.offset}")


def _storage_reader(md: DcpMetadata):
    """torch's ``FileSystemReader``, handed our safely read metadata instead of
    unpickling ``.metadata`` itself."""
    from torch.distributed.checkpoint import FileSystemReader

    class _CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return md.torch_raw

    return _CheckedReader(md.folder)


def load_into(state: dict[str, torch.Tensor], reader, folder: Path) -> None:
    """``dcp.load`` without a process group; its errors as one ``SourceError``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
            dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        names = _some(list(state), 2)
        raise SourceError(f"{folder}: reading {names} failed ({cause(exc)})") from None


def cause(exc: BaseException) -> str:
    """The first underlying error of a ``CheckpointException`` (which wraps each
    rank's), as its type and first sentence."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            exc = inner
            break
    lines = str(exc).strip().splitlines()
    first = lines[0].split(". ")[0] if lines else ""
    return f"{type(exc).__name__}: {first}".rstrip(": ")
