"""Rendering what convert, restore and reshard wrote: Rich, and JSON documents.

Schemas: ``yafsdp.convert/1``, ``yafsdp.restore/1``, ``yafsdp.reshard/1``; each
document is the result dataclass as plain data under ``"schema"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING

from ..checkpoint.results import (
    CheckpointInfo,
    ConvertResult,
    ReshardResult,
    RestoreResult,
    RoundTrip,
)
from .formatting import human_bytes, human_count, json_document, rich_table, unbroken

if TYPE_CHECKING:  # Rich is imported by the views only: the JSON documents never need it
    from rich.text import Text

SCHEMA_CONVERT = "yafsdp.convert/1"
SCHEMA_RESTORE = "yafsdp.restore/1"
SCHEMA_RESHARD = "yafsdp.reshard/1"
ROWS_HEAD, ROWS_TAIL = 12, 3  # rows shown of a long table


def convert_json(result: ConvertResult) -> str:
    return json_document(SCHEMA_CONVERT, _fields(result))


def restore_json(result: RestoreResult) -> str:
    return json_document(SCHEMA_RESTORE, _fields(result))


def reshard_json(result: ReshardResult) -> str:
    return json_document(SCHEMA_RESHARD, _fields(result))


def _fields(result) -> dict:
    return {name: getattr(result, name) for name in result.__dataclass_fields__}


# ---------------------------------------------------------------- Rich


def convert_view(result: ConvertResult) -> list:
    from rich.text import Text

    ck = result.checkpoint
    if result.written:
        head = f"wrote {_where(ck)}"
    else:
        head = f"[bold red]nothing written:[/] --verify failed; {ck.path} was left as it was"
    lines = [
        unbroken(head) if result.written else Text.from_markup(head),
        Text(
            f"{result.converted} parameters ({human_count(result.converted_numel)} elements) "
            f"in {len(ck.buffers)} flat buffers, {len(ck.kept)} tensors kept as they are; "
            f"read {human_bytes(result.bytes_read)} from {result.source}"
        ),
        buffers_table(ck),
    ]
    if ck.sharded:
        lines.append(files_table(ck))
    lines += [Text(f"note: {n}", style="dim") for n in result.notes]
    if result.verify is not None:
        lines.append(verify_text(result.verify))
    return lines


def restore_view(result: RestoreResult) -> list:
    from rich.text import Text

    tied = f", {len(result.tied)} tied names stored once" if result.tied else ""
    return [
        unbroken(
            f"restored {result.tensors} tensors ({result.names} names{tied}) to "
            f"{result.output.path} ({result.format}, {human_bytes(result.output.nbytes)})"
        ),
        Text(
            f"checked {result.checked} stored tensors of {result.input} (checksums, zero "
            f"padding; world size {result.input_world_size}, "
            f"{'sharded set' if result.input_sharded else 'one file'})",
            style="dim",
        ),
    ]


def reshard_view(result: ReshardResult) -> list:
    from rich.text import Text

    ck = result.checkpoint
    was = "sharded set" if result.input_sharded else "one file"
    lines = [
        Text(f"resharded {result.input} (world size {result.input_world_size}, {was})"),
        unbroken(f"wrote {_where(ck)}"),
        buffers_table(ck),
    ]
    if ck.sharded:
        lines.append(files_table(ck))
    lines.append(Text(f"checked {result.checked} stored tensors of the input", style="dim"))
    return lines


def _where(ck: CheckpointInfo) -> str:
    form = f"{len(ck.files)} rank files + {ck.index}" if ck.sharded else "one file"
    return (
        f"{ck.path} ({form}, {human_bytes(ck.nbytes)}; world size {ck.world_size}, "
        f"--align {ck.align}, {ck.checksum} checksums)"
    )


def verify_text(v: RoundTrip) -> Text:
    from rich.text import Text

    if v.ok:
        return Text(
            f"verified: {v.tensors} tensors ({human_bytes(v.nbytes)}) read back bit for bit; "
            f"model check: {v.model_check}",
            style="green",
        )
    if v.mismatches:
        text = f"verify FAILED: {len(v.mismatches)} tensors differ from the source: " + ", ".join(
            v.mismatches[:5]
        )
    else:
        text = f"verify FAILED: tensors read back bit for bit, but model check {v.model_check}"
    return Text(text, style="bold red")


def buffers_table(ck: CheckpointInfo):
    """One row per buffer; long names fold to their distinguishing last parts."""
    headers = ("buffer (tensor name)", "params", "numel", "padded", "per rank", "bytes")
    rows = [
        (
            b.name,
            str(b.entries),
            human_count(b.numel),
            human_count(b.padded_numel),
            human_count(b.shard_numel),
            human_bytes(b.nbytes),
        )
        for b in ck.buffers
    ]
    return rich_table("flat buffers", headers, _fold(rows, 6), right=range(1, 6), names=(0,))


def files_table(ck: CheckpointInfo):
    rows = [(f.rank, PurePath(f.path).name, human_bytes(f.nbytes)) for f in ck.files]
    title = f"rank files in {ck.path}"
    return rich_table(title, ("rank", "file", "bytes"), _fold(rows, 3), right=(0, 2))


def _fold(rows: Sequence[tuple], width: int) -> list[tuple]:
    if len(rows) <= ROWS_HEAD + ROWS_TAIL + 1:
        return list(rows)
    more = (f"... {len(rows) - ROWS_HEAD - ROWS_TAIL} more", *([""] * (width - 1)))
    return [*rows[:ROWS_HEAD], more, *rows[-ROWS_TAIL:]]
