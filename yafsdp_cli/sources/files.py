"""Weight files by kind: safetensors (header only), torch state dicts and pickles.

``load_file`` picks the reader by suffix (or by sniffing the first bytes) and
returns a ``LoadedModel`` with a spec made from names, shapes and dtypes alone.
Folders and factories are ``load``'s business.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from ..engine.records import ModelSpec, TensorRecord
from ..engine.units import detect_units_from_names, name_prefixes
from ..errors import SourceError
from ..fileio import require_inside
from .loaded import NO_ARCH_NOTE, LoadedModel

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def load_file(path: Path, trust_pickle: bool) -> LoadedModel:
    """A weights file (not a folder) as a ``LoadedModel``."""
    name = path.name.lower()
    if name == ".metadata" or name.endswith(".distcp"):
        return _load_dcp_part(path)
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return load_safetensors(path)
    if name.endswith(TORCH_SUFFIXES) or name.endswith(".index.json"):  # pytorch_model.bin sets
        return load_torch(path, trust_pickle)
    if name.endswith(".pt2"):
        from .export import load_export

        return load_export(path, trust_pickle)
    return _sniff(path, trust_pickle)


def weights_in_folder(path: Path) -> Path | None:
    """The usual weight files of a model folder: a DCP checkpoint's ``.metadata``
    (written last, so it marks a complete checkpoint), then safetensors first. The
    weights (or their index) must lie in the folder, not behind a link out of it."""
    if (path / ".metadata").is_file():
        return path / ".metadata"
    found = _weights_file(path)
    if found is not None:
        require_inside(path, found)
    return found


def _weights_file(path: Path) -> Path | None:
    for pattern in (
        "*.safetensors.index.json",
        "*.safetensors",
        "*.bin.index.json",
        "*.bin",
        "*.pt",
    ):
        found = sorted(path.glob(pattern))
        if len(found) == 1 or (found and pattern.endswith(".index.json")):
            return found[0]
        if found and pattern == "*.safetensors":
            raise SourceError(f"{path}: several safetensors files and no index; name one of them")
    return None


def _load_dcp_part(path: Path) -> LoadedModel:
    """A DCP folder, given by its ``.metadata``: the weights' spec and a streaming
    reader; the rest of the checkpoint is described in ``extra["checkpoint_state"]``."""
    from .dcp_folder import open_dcp

    if path.name != ".metadata":
        raise SourceError(
            f"{path} is one rank's part of a torch.distributed.checkpoint (DCP) folder; "
            "give the folder that holds it and its .metadata"
        )
    opened = open_dcp(path.parent)
    reader = opened.reader
    names = sorted(reader.names(), key=natural_key)
    items = [(n, reader.tensor_meta(n).shape, reader.tensor_meta(n).dtype) for n in names]
    spec = spec_from_tensors(
        items, {}, source=str(path.parent), source_kind="dcp", notes=list(opened.notes)
    )
    extra = {"checkpoint_state": opened.state}
    return LoadedModel(spec=spec, reader=reader, path=path.parent, extra=extra)


def _sniff(path: Path, trust_pickle: bool) -> LoadedModel:
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:2] == b"PK" or head[:1] == b"\x80":
        return load_torch(path, trust_pickle)
    if len(head) == 9 and head[8:9] == b"{":
        return load_safetensors(path)
    raise SourceError(
        f"{path}: unknown file type; expected .safetensors, .safetensors.index.json, "
        ".pt/.pth/.bin, .pt2 or a model folder"
    )


def natural_key(name: str) -> list:
    """``layers.10`` after ``layers.9``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def spec_from_tensors(
    items: list[tuple[str, tuple[int, ...], str]],
    aliases: dict[str, list[str]],
    *,
    source: str,
    source_kind: str,
    notes: list[str],
    metadata: dict[str, str] | None = None,
) -> ModelSpec:
    """A spec for tensors known only by name, shape and dtype (no architecture)."""
    from ..engine import dtypes

    alias_of = {a for names in aliases.values() for a in names}
    records = tuple(
        TensorRecord(
            name,
            shape,
            dtype,
            aliases=tuple(aliases.get(name, ())),
            is_param=dtypes.is_floating(dtype),
        )
        for name, shape, dtype in items
        if name not in alias_of
    )
    if aliases:
        pairs = "; ".join(f"{k} = {', '.join(v)}" for k, v in aliases.items())
        notes = [*notes, f"tied names found in the file: {pairs}"]
    else:
        notes = [*notes, "tied weights cannot be known without an architecture"]
    all_names = [n for t in records for n in t.names]
    return ModelSpec(
        tensors=records,
        has_architecture=False,
        units=detect_units_from_names(records),
        module_names=tuple(dict.fromkeys(p for n in all_names for p in name_prefixes(n))),
        notes=(NO_ARCH_NOTE, *notes),
        source=source,
        source_kind=source_kind,
        metadata=dict(metadata or {}),
    )


def load_safetensors(path: Path) -> LoadedModel:
    from .safetensors_file import open_safetensors

    reader = open_safetensors(path)
    metadata = {k: v for h in reader.headers for k, v in h.metadata.items()}
    entries = sorted(reader.entries.values(), key=lambda e: natural_key(e.name))
    aliases: dict[str, list[str]] = {}
    # safetensors.torch.save_model stores a tied tensor once and records
    # {dropped_name: kept_name} in the metadata.
    for dropped, kept in metadata.items():
        if kept in reader.entries and dropped not in reader.entries and "." in dropped:
            aliases.setdefault(kept, []).append(dropped)
    spec = spec_from_tensors(
        [(e.name, e.shape, e.dtype) for e in entries],
        aliases,
        source=str(path),
        source_kind="safetensors",
        notes=[],
        metadata=metadata,
    )
    return LoadedModel(spec=spec, reader=reader, path=path)


def load_torch(path: Path, trust_pickle: bool) -> LoadedModel:
    from torch import nn

    from ..engine.module_spec import spec_from_module
    from .torch_file import (
        TensorDictReader,
        find_state_dict,
        load_torch_file,
        load_torch_index,
        module_tensors,
        shared_names,
    )

    if path.name.endswith(".index.json"):
        obj, notes = load_torch_index(path), []
    else:
        obj, notes = load_torch_file(path, trust_pickle=trust_pickle)
    if isinstance(obj, nn.Module):
        spec = spec_from_module(obj, source=str(path), source_kind="pickled module", notes=notes)
        return LoadedModel(
            spec=spec, reader=TensorDictReader(module_tensors(obj)), module=obj, path=path
        )
    tensors, more = find_state_dict(obj, path)
    from ..engine import dtypes

    items = [(n, tuple(t.shape), dtypes.from_torch(t.dtype)) for n, t in tensors.items()]
    spec = spec_from_tensors(
        items, shared_names(tensors), source=str(path), source_kind="state dict", notes=notes + more
    )
    return LoadedModel(spec=spec, reader=TensorDictReader(tensors), path=path)


def with_spec(loaded: LoadedModel, spec: ModelSpec) -> LoadedModel:
    return replace(loaded, spec=spec)
