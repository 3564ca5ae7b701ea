"""Flat-buffer checkpoints: write (convert), read back (restore), re-split (reshard).

A flat checkpoint is a plain safetensors file: each flat buffer is one 1-D tensor
named by its ``BufferLayout.name`` (padding included, padding bytes zero), every
other tensor keeps its name, and ``__metadata__`` holds the layout and a checksum
per stored tensor (see ``format.py``). With ``sharded=True`` it is a folder of
``rank-RRRRR-of-NNNNN.safetensors`` files, rank ``r`` holding slice ``r`` of every
buffer and a copy of every kept tensor, plus ``yafsdp.index.json``.

A training checkpoint (DCP ``{"model", "optimizer", ...}``, a ``torch.save`` dict
of the same, or a Hugging Face Trainer folder) keeps its optimizer state: each state
tensor a flat buffer ``BUFFER@FIELD`` with its parameters' layout, the rest JSON in
the metadata (format version 2); reshard moves it with the weights, and restore writes
the source's own layout back.

Modules by role:

- the commands' library calls: ``convert`` (a model source to a flat checkpoint),
  ``reshard`` (re-split for another world size), and the ``restore`` package (back to
  a state dict): ``restore.read_back`` reads a flat checkpoint back into named
  tensors and optimizer state once for every output, then one module per output
  format writes them: ``restore.to_file`` (``.safetensors`` or ``torch.save``),
  ``restore.to_dcp`` (a torch.distributed.checkpoint folder, for FSDP2 and
  torchtitan) and ``restore.to_trainer`` (a Hugging Face Trainer folder);
- the format and its checks: ``format`` (names, metadata, checksums, data order),
  ``reader`` (opening and checking), ``integrity`` (checksums and zero padding as
  the bytes give them), ``crc``, and ``results`` (what each command did);
- writing: ``writer`` (one streamed safetensors file; all-or-nothing, staged
  outputs), ``flat_writer`` (buffers routed to rank files; ``parallel_ranks`` writes
  the rank files side by side), ``dcp_write`` (a DCP folder without torch), and
  ``file_ranges`` (moving bytes by file ranges, as the kernel copies);
- optimizer state: ``optim_state`` (state buffers and the ``yafsdp.optimizer``
  record) and ``master_weights`` (float32 masters as state);
- training from and to a checkpoint: ``flat_training`` (AdamW on a ``FlatModel``'s
  buffers) and ``sharded_training`` (the same on each rank of a ``ShardedFlat`` run:
  its slice, its rank file).

It may import ``options``, ``sources``, ``engine``, ``fileio`` and ``errors``; only
``cli`` and ``report`` import it.

Everything streams: no function here holds a model, and none imports torch except
``restore`` to ``.pt`` or a Trainer folder (and a source that needs it, such as a
``.pt`` state dict).

>>> from yafsdp_cli.checkpoint import convert_checkpoint, restore_checkpoint
>>> from yafsdp_cli.options import LayoutOptions
>>> layout = LayoutOptions(world_size=8)
>>> convert_checkpoint("model.safetensors", "flat.safetensors", layout)  # doctest: +SKIP
>>> restore_checkpoint("flat.safetensors", "model.restored.safetensors")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy

# Where each public name lives: a command imports only the modules it runs
# (``restore`` never imports ``convert``; ``lazy.py`` says why).
_HOMES = {
    "convert_checkpoint": "convert",
    "write_converted": "convert",
    "CHECKSUM_ALGO": "format",
    "FORMAT_VERSION": "format",
    "INDEX_NAME": "format",
    "FlatCheckpoint": "reader",
    "open_flat": "reader",
    "relayout": "reshard",
    "reshard_checkpoint": "reshard",
    "restore_checkpoint": "restore",
    **dict.fromkeys(
        ("BufferInfo", "CheckpointInfo", "ConvertResult", "Progress", "ReshardResult",
         "RestoreResult", "RoundTrip", "WrittenFile"),
        "results",
    ),
}  # fmt: skip

if TYPE_CHECKING:
    from .convert import convert_checkpoint, write_converted
    from .format import CHECKSUM_ALGO, FORMAT_VERSION, INDEX_NAME
    from .reader import FlatCheckpoint, open_flat
    from .reshard import relayout, reshard_checkpoint
    from .restore import restore_checkpoint
    from .results import (
        BufferInfo,
        CheckpointInfo,
        ConvertResult,
        Progress,
        ReshardResult,
        RestoreResult,
        RoundTrip,
        WrittenFile,
    )


def __getattr__(name: str):
    return lazy.attribute(__name__, _HOMES, name)


__all__ = [
    "CHECKSUM_ALGO",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "BufferInfo",
    "CheckpointInfo",
    "ConvertResult",
    "FlatCheckpoint",
    "Progress",
    "ReshardResult",
    "RestoreResult",
    "RoundTrip",
    "WrittenFile",
    "convert_checkpoint",
    "open_flat",
    "relayout",
    "reshard_checkpoint",
    "restore_checkpoint",
    "write_converted",
]
