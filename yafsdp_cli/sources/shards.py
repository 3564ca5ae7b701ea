"""Where a sharded set's index points: only at files beside it.

An index (``*.safetensors.index.json``, ``pytorch_model.bin.index.json``) is one
downloaded JSON document; its ``weight_map`` must not reach other files. A shard is
a plain file name in the index's folder, never a path (``..``, ``/etc/passwd``,
``sub/x``). A shard may be a symbolic link only to a file in the same folder, or,
in a Hugging Face hub cache (``models--org--name/snapshots/REV/``), to the repo's
own ``blobs/`` folder, which is how the hub stores every file it downloads.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError
from ..fileio import in_hub_blobs


def shard_names(index: Path, weight_map: dict) -> list[str]:
    """The distinct shard names of a ``weight_map``, in order; each must be a string."""
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise SourceError(
                f"{index}: weight_map maps {tensor!r} to {name!r}, not a shard file name"
            )
    return list(dict.fromkeys(weight_map.values()))


def shard_path(index: Path, name: object) -> Path:
    """The shard ``name`` of the set whose index is ``index``; raises ``SourceError``."""
    text = name if isinstance(name, str) else ""
    if not text or Path(text).name != text or text in (".", "..") or "\\" in text:
        raise SourceError(
            f"{index}: weight_map names {name!r}, outside its folder; the shards of a set "
            "are plain file names beside its index"
        )
    path = index.parent / text
    if path.is_symlink():
        target = path.resolve()
        if target.parent != index.parent.resolve() and not in_hub_blobs(index.parent, target):
            raise SourceError(
                f"{index}: weight_map names {text!r}, a link to {target}, outside its folder; "
                "copy the shard itself beside the index"
            )
    if not path.exists():
        raise SourceError(f"{index}: weight_map names {text!r}, which does not exist")
    return path
