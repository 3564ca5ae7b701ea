"""What convert, restore and reshard did: frozen dataclasses, JSON via ``plain``.

Sizes are bytes and elements; the report layer formats them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# progress(phase, done, total): phase is "writing", "checking" or "comparing";
# done/total count bytes of that phase. Called after every chunk.
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class WrittenFile:
    path: str
    rank: int | None  # None: a single flat file (or a restored state dict)
    nbytes: int  # the whole file, header included
    checksums: dict[str, str]  # tensor name -> checksum of its bytes


@dataclass(frozen=True, slots=True)
class BufferInfo:
    name: str
    unit: str
    dtype: str
    entries: int
    numel: int  # parameter elements
    padded_numel: int  # stored elements, padding included
    world_size: int
    shard_numel: int  # elements per rank
    nbytes: int  # padded_numel * itemsize


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A flat checkpoint as written: one file, or a folder of rank files + index."""

    path: str  # the file, or the folder of a sharded set
    sharded: bool
    index: str | None  # the index file of a sharded set
    world_size: int
    align: str
    checksum: str  # algorithm
    files: tuple[WrittenFile, ...]  # in rank order
    buffers: tuple[BufferInfo, ...]
    kept: tuple[str, ...]  # tensors stored under their own names
    nbytes: int  # all files together


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """``convert --verify``: the written checkpoint read back against the source."""

    ok: bool
    tensors: int  # tensors compared byte for byte
    nbytes: int
    mismatches: tuple[str, ...]  # names (or "layout") that differ
    model_check: str  # the forward/backward check: its outcome, or why it did not run
    model_ok: bool | None = None  # None: that check did not run


@dataclass(frozen=True, slots=True)
class ConvertResult:
    source: str
    source_kind: str
    written: bool  # False only when --verify failed (nothing is left behind)
    checkpoint: CheckpointInfo
    converted: int  # parameters in flat buffers
    converted_numel: int
    bytes_read: int  # tensor bytes read from the source
    notes: tuple[str, ...]
    verify: RoundTrip | None


@dataclass(frozen=True, slots=True)
class RestoreResult:
    input: str
    input_world_size: int
    input_sharded: bool
    checked: int  # stored tensors whose checksums and padding were verified
    output: WrittenFile
    format: str  # "safetensors", "pt", "dcp" or "trainer"
    tensors: int  # tensors written (a tied tensor once)
    names: int  # names restored (tied names each)
    tied: dict[str, str]  # dropped name -> stored name, as safetensors.torch.save_model


def restored(ckpt, out, *, nbytes: int, checked: int, fmt: str, tensors: int, tied=None):
    """The ``RestoreResult`` of writing ``nbytes`` to ``out`` from flat checkpoint
    ``ckpt``; names are the tensors written plus the tied names dropped."""
    tied = tied or {}
    return RestoreResult(
        input=str(ckpt.root),
        input_world_size=ckpt.layout.world_size,
        input_sharded=ckpt.sharded,
        checked=checked,
        output=WrittenFile(str(out), None, nbytes, {}),
        format=fmt,
        tensors=tensors,
        names=tensors + len(tied),
        tied=tied,
    )


@dataclass(frozen=True, slots=True)
class ReshardResult:
    input: str
    input_world_size: int
    input_sharded: bool
    checked: int
    checkpoint: CheckpointInfo
