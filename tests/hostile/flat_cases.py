"""Bad flat checkpoints: flipped bytes, layouts that lie under a recomputed checksum,
missing checksums, rank files missing, duplicated or from another conversion."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from conftest import SAMPLES

from yafsdp_cli.options import LayoutOptions

from .common import Case

FLAT_COMMANDS = ("restore", "reshard")
BUFFER = "__flat__.float32"
KEPT = "features.1.num_batches_tracked"


def make_flat(folder: Path, *, sharded: bool = False, sample: str = "cnn", name="") -> Path:
    from yafsdp_cli.checkpoint import convert_checkpoint

    path = folder / (name or ("set" if sharded else "flat.safetensors"))
    convert_checkpoint(
        SAMPLES / f"{sample}.safetensors", path, LayoutOptions(world_size=2), sharded=sharded
    )
    return path


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _flip(tensor: str):
    def build(folder: Path) -> Path:
        path = make_flat(folder)
        header, data = split(path)
        begin, _ = header[tensor]["data_offsets"]
        data = bytearray(data)
        data[begin + 3] ^= 0x40
        join(path, header, bytes(data))
        return path

    return build


def _lie(edit: Callable[[dict], None]):
    """Edit the layout, then recompute its checksum as a forger would."""

    def build(folder: Path) -> Path:
        from yafsdp_cli.checkpoint.format import KEY_LAYOUT, KEY_LAYOUT_SUM, checksum_of

        path = make_flat(folder)
        header, data = split(path)
        meta = header["__metadata__"]
        layout = json.loads(meta[KEY_LAYOUT])
        edit(layout)
        text = json.dumps(layout, separators=(",", ":"))
        meta[KEY_LAYOUT], meta[KEY_LAYOUT_SUM] = text, checksum_of(text.encode())
        join(path, header, data)
        return path

    return build


def _overlap(layout: dict) -> None:
    entries = layout["buffers"][0]["entries"]
    entries[1]["offset"] = entries[0]["offset"]


def _past_the_end(layout: dict) -> None:
    b = layout["buffers"][0]
    last = b["entries"][-1]
    last["offset"] = b["padded_numel"] + 8
    b["end"] = last["offset"] + last["numel"]


def _shape_mismatch(layout: dict) -> None:
    e = layout["buffers"][0]["entries"][0]
    e["shape"] = [e["numel"] + 1]


def _absurd_world(layout: dict) -> None:
    layout["world_size"] = 2**40
    for b in layout["buffers"]:
        b["world_size"] = 2**40


def _no_checksums(folder: Path) -> Path:
    from yafsdp_cli.checkpoint.format import KEY_CHECKSUMS

    path = make_flat(folder)
    header, data = split(path)
    del header["__metadata__"][KEY_CHECKSUMS]
    join(path, header, data)
    return path


def _rank(edit: Callable[[Path, Path], None]):
    def build(folder: Path) -> Path:
        path = make_flat(folder, sharded=True)
        edit(path, folder)
        return path

    return build


R0, R1 = "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"


def _missing(path: Path, folder: Path) -> None:
    (path / R1).unlink()


def _duplicated(path: Path, folder: Path) -> None:
    shutil.copyfile(path / R0, path / R1)


def _foreign(path: Path, folder: Path) -> None:
    other = make_flat(folder, sharded=True, sample="mlp", name="other")
    shutil.copyfile(other / R1, path / R1)
    shutil.rmtree(other)


FLAT = [
    Case("flat-flipped-buffer-byte", _flip(BUFFER), f"buffer '{BUFFER}' fails its checksum"),
    Case("flat-flipped-kept-byte", _flip(KEPT), f"tensor '{KEPT}' fails its checksum"),
    Case("flat-layout-overlap", _lie(_overlap), "overlapping up to"),
    Case("flat-layout-past-the-end", _lie(_past_the_end), "padded numel \\d+ is not \\d+"),
    Case("flat-layout-shape-numel", _lie(_shape_mismatch), "numel \\d+ != prod"),
    Case("flat-layout-absurd-world", _lie(_absurd_world), "world size 1099511627776"),
    Case("flat-no-checksums", _no_checksums, "metadata has no 'yafsdp.checksums'"),
    Case("flat-rank-missing", _rank(_missing), f"rank 1's file {R1} is missing"),
    Case("flat-rank-duplicated", _rank(_duplicated), "is not rank 1 of this set"),
    Case("flat-rank-foreign", _rank(_foreign), "different layout than the index"),
]
for _c in FLAT:
    _c.commands = FLAT_COMMANDS
