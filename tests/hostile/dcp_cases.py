"""Bad DCP folders (``.metadata`` and ``.distcp`` files), written without torch.

The metadata is pickled from ``dcp_pickle``'s stand-ins under torch's names, as
``dcp.save`` writes it, so each builder states exactly what the hostile part is:
a link out of the folder, a shape past 2^63 bytes, shared or deeply nested lists,
a name holding terminal escapes. A ``.distcp`` file is filler of the right length
where nothing reads its bytes before the refusal.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

from yafsdp_cli.sources.dcp_pickle import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    Size,
    TensorProperties,
    TensorStorageMetadata,
    _StorageInfo,
    dump_metadata,
)
from yafsdp_cli.sources.torch_pickle import Dtype

from .common import Case
from .st_cases import SOURCE_COMMANDS

DATA = "__0_0.distcp"


def metadata(tensors: dict, *, path: str = DATA, length: int = 64) -> Metadata:
    """Metadata of float32 tensors ``{fqn: (shape, [(offsets, sizes), ...])}`` (one
    whole chunk when the list is left out), every chunk stored in ``path``."""
    sd, storage, pos = {}, {}, 0
    for fqn, spec in tensors.items():
        shape, chunks = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, None)
        chunks = chunks if chunks is not None else [([0] * len(shape), list(shape))]
        meta_chunks = []
        for offsets, sizes in chunks:
            meta_chunks.append(ChunkStorageMetadata(offsets=Size(offsets), sizes=Size(sizes)))
            key = MetadataIndex(fqn=fqn, offset=Size(offsets), index=None)
            storage[key] = _StorageInfo(relative_path=path, offset=pos, length=length)
            pos += length
        props = TensorProperties(Dtype.named("float32"))
        sd[fqn] = TensorStorageMetadata(properties=props, size=Size(shape), chunks=meta_chunks)
    planner = {fqn: ("model", fqn.split(".", 1)[1]) for fqn in tensors if "." in fqn}
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage)


def write_folder(folder: Path, md: Metadata, *, files: bool = True) -> Path:
    """``folder/ck`` holding ``md`` as ``.metadata`` and, unless ``files`` is False,
    zero filler in each file its records name (those that are plain names), as
    long as the records say."""
    ck = folder / "ck"
    ck.mkdir()
    buf = io.BytesIO()
    dump_metadata(md, buf)
    (ck / ".metadata").write_bytes(buf.getvalue())
    ends: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str) and name and "\0" not in name and Path(name).name == name:
            ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in ends.items() if files else ():
        (ck / name).write_bytes(b"\0" * end)
    return ck


GOOD = {"model.w": ([4, 4], None)}


def _good(folder: Path) -> Path:
    return write_folder(folder, metadata(GOOD))


# ------------------------------------------------------------------ links


def _data_link(folder: Path) -> Path:
    """The data file is a link to a file beside the folder, not in it."""
    ck = _good(folder)
    secret = folder / "secret.bin"
    secret.write_bytes(b"TOKEN=hunter2\n" * 100)
    (ck / DATA).unlink()
    (ck / DATA).symlink_to(secret)
    return ck


def _metadata_link(folder: Path) -> Path:
    ck = _good(folder)
    outside = folder / "elsewhere.metadata"
    os.replace(ck / ".metadata", outside)
    (ck / ".metadata").symlink_to(outside)
    return ck


def _path(name: str, files: bool = True):
    return lambda folder: write_folder(folder, metadata(GOOD, path=name), files=files)


# ------------------------------------------------------------------ sizes


def _huge(shape, chunks=None):
    return lambda folder: write_folder(folder, metadata({"model.w": (shape, chunks)}))


def _shared_lists(folder: Path) -> Path:
    """A shape whose one entry is a list of two references to one list of two
    references to ... (22 levels): a few hundred bytes of pickle, 4 million elements
    when walked or printed."""
    md = metadata(GOOD)
    inner: list = [1]
    for _ in range(22):
        inner = [inner, inner]
    md.state_dict_metadata["model.w"].size = [inner]
    return write_folder(folder, md)


def _deep_shape(folder: Path) -> Path:
    """A shape nested 100,000 lists deep: the pickler would recurse too deeply, so
    the lists are written opcode by opcode where a placeholder string was."""
    md = metadata(GOOD)
    md.state_dict_metadata["model.w"].size = "DEEPSHAPE"
    ck = write_folder(folder, md)
    raw = (ck / ".metadata").read_bytes()
    placeholder = pickle.SHORT_BINUNICODE + bytes([9]) + b"DEEPSHAPE"
    depth = 100_000
    nested = pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)
    assert raw.count(placeholder) == 1
    (ck / ".metadata").write_bytes(raw.replace(placeholder, nested))
    return ck


def _many_chunks(n: int):
    """``n`` chunks of one column each, every one starting at row 0 (so a sweep
    along dim 0 alone keeps them all in play): a valid tiling of ``[1, n]``."""
    chunks = [([0, i], [1, 1]) for i in reversed(range(n))]
    return lambda folder: write_folder(folder, metadata({"model.w": ([1, n], chunks)}, length=8))


# ------------------------------------------------------------------ saved by torch


def _saved(state_of):
    """A folder ``dcp.save`` writes (one process, no process group) of the tiny
    model ``nn.Linear(4, 2)`` and whatever ``state_of(model)`` adds beside it."""

    def build(folder: Path) -> Path:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        state = {"model": model.state_dict(), **state_of(model)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(folder / "ck"), no_dist=True)
        return folder / "ck"

    return build


def _positional(model) -> dict:
    """``optimizer.state_dict()`` as it is, state keyed 0, 1, ...: one AdamW step."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return {"optimizer": opt.state_dict()}


def _shared_value(model) -> dict:
    """A pickled entry beside the weights: one list referenced 2^20 times."""
    inner: list = [0]
    for _ in range(20):
        inner = [inner, inner]
    return {"train_state": {"history": inner}}


def _deep_value(model) -> dict:
    inner: list = []
    for _ in range(200):
        inner = [inner]
    return {"train_state": {"history": inner}}


def _overlap_among_many(n: int):
    """``n`` one-column chunks of ``[1, n]`` with column 0 twice and column n - 1
    left out: sizes that add up, one overlap that a pairwise check finds last."""
    chunks = [([0, i], [1, 1]) for i in reversed(range(n - 1))] + [([0, 0], [1, 1])]
    return lambda folder: write_folder(folder, metadata({"model.w": ([1, n], chunks)}, length=8))


ESC = "\x1b[2J\x1b]0;pwned\x07"

DCP = [
    Case("dcp-data-file-links-out", _data_link, r"__0_0\.distcp is a symbolic link out of"),
    Case("dcp-metadata-links-out", _metadata_link, r"\.metadata is a symbolic link out of"),
    Case("dcp-nul-in-relative-path", _path("a\0b.distcp"), r"stored in 'a\\x00b\.distcp', outside"),
    Case(
        "dcp-escapes-in-relative-path",
        _path(ESC + ".distcp", files=False),
        r"stored in \\x1b\[2J\\x1b\]0;pwned\\x07\.distcp, which is missing",
    ),
    Case("dcp-shape-over-2^63-bytes", _huge([2**40, 2**40]), "more than 2\\^63 bytes"),
    Case("dcp-shared-sub-lists", _shared_lists, "bad shape"),
    Case(
        "dcp-shape-nested-100000-deep",
        _deep_shape,
        r"tensor 'model.w' has a bad shape \[\[\[.*\]: its dimensions are not all whole numbers",
    ),
    Case(
        "dcp-overlap-among-3000-chunks",
        _overlap_among_many(3000),
        r"has overlapping chunks at offsets \[0, 0\] and \[0, 0\]",
    ),
]
for _c in DCP:
    _c.commands = (*SOURCE_COMMANDS, "plan")

TRAINING = [
    Case(
        "dcp-optimizer-state-by-position",
        _saved(_positional),
        r"numbers its parameters by position \(0\.\.1\), as optimizer\.state_dict\(\) does;.*"
        r"--model .*get_optimizer_state_dict",
        commands=("convert",),
    ),
    Case(
        "dcp-value-of-shared-sub-lists",
        _saved(_shared_value),
        r"reading 'train_state\.history' failed \(.*far more items than its size warrants",
        commands=("convert",),
    ),
    Case(
        "dcp-value-nested-200-deep",
        _saved(_deep_value),
        r"reading 'train_state\.history' failed \(.*nests more than 100 deep",
        commands=("convert",),
    ),
]
DCP += TRAINING
