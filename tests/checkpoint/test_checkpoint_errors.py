"""Hostile flat checkpoints and unsafe outputs: each refused with a clear error,
inputs untouched, nothing partial left behind."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoint_helpers import crc, read_header, reseal, sample, write_raw

from yafsdp_cli import CheckpointError, SourceError, YafsdpError
from yafsdp_cli.checkpoint import (
    INDEX_NAME,
    convert_checkpoint,
    reshard_checkpoint,
    restore_checkpoint,
)
from yafsdp_cli.checkpoint import convert as convert_mod
from yafsdp_cli.options import LayoutOptions


@pytest.fixture
def flat(tmp_path):
    path = tmp_path / "flat.safetensors"
    convert_checkpoint(
        sample("gpt.safetensors"), path, LayoutOptions(world_size=4, align="megatron")
    )
    return path


@pytest.fixture
def sharded(tmp_path):
    path = tmp_path / "set"
    convert_checkpoint(sample("cnn.safetensors"), path, LayoutOptions(world_size=4), sharded=True)
    return path


def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_tampered_data_byte_is_refused(tmp_path, flat):
    header, data = read_header(flat)
    name = "__flat__.transformer.h.1.float32"
    a, _ = header[name]["data_offsets"]
    data = bytearray(data)
    data[a + 100] ^= 0x01
    write_raw(flat, header, bytes(data))
    with pytest.raises(CheckpointError, match=rf"buffer '{name}' fails its checksum"):
        restore_checkpoint(flat, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_nonzero_padding_is_refused_even_with_a_matching_checksum(tmp_path, flat):
    header, data = read_header(flat)
    layout = json.loads(header["__metadata__"]["yafsdp.layout"])
    buf = next(b for b in layout["buffers"] if b["padded_numel"] > b["end"])
    a, _ = header[buf["name"]]["data_offsets"]
    data = bytearray(data)
    data[a + buf["end"] * 4] = 0x7F  # first byte of the tail padding
    write_raw(flat, reseal(header, bytes(data)), bytes(data))
    with pytest.raises(CheckpointError, match=rf"padding of buffer '{buf['name']}' is not zero"):
        reshard_checkpoint(flat, tmp_path / "out.safetensors", world_size=2)


def test_tampered_layout_metadata_is_refused(tmp_path, flat):
    header, data = read_header(flat)
    layout = json.loads(header["__metadata__"]["yafsdp.layout"])
    e = layout["buffers"][1]["entries"]
    e[0]["name"], e[1]["name"] = e[1]["name"], e[0]["name"]  # still a valid layout
    header["__metadata__"]["yafsdp.layout"] = json.dumps(layout, separators=(",", ":"))
    write_raw(flat, header, data)
    with pytest.raises(CheckpointError, match="layout metadata does not match its checksum"):
        restore_checkpoint(flat, tmp_path / "out.safetensors")


def test_header_that_disagrees_with_the_layout_is_refused(tmp_path, flat):
    header, data = read_header(flat)
    (n,) = header["__flat__.float32"]["shape"]
    header["__flat__.float32"]["shape"] = [n // 128, 128]  # same bytes, other shape
    write_raw(flat, header, data)
    with pytest.raises(
        CheckpointError, match=r"buffer '__flat__.float32' is float32\[\d+, 128\] in the header"
    ):
        restore_checkpoint(flat, tmp_path / "out.safetensors")


def test_a_broken_layout_is_refused(tmp_path, flat):
    header, data = read_header(flat)
    meta = header["__metadata__"]
    layout = json.loads(meta["yafsdp.layout"])
    layout["buffers"][1]["entries"][1]["offset"] = 3  # overlaps the first entry
    meta["yafsdp.layout"] = json.dumps(layout, separators=(",", ":"))
    meta["yafsdp.layout_checksum"] = crc(meta["yafsdp.layout"].encode())
    write_raw(flat, header, data)
    with pytest.raises(CheckpointError, match="offset 3 not a multiple of 64"):
        restore_checkpoint(flat, tmp_path / "out.safetensors")


def test_extra_and_missing_tensors_are_refused(tmp_path, flat):
    header, data = read_header(flat)
    header["extra"] = header.pop("__flat__.float32")
    write_raw(flat, header, data)
    with pytest.raises(CheckpointError, match="buffer '__flat__.float32' of the layout is missing"):
        restore_checkpoint(flat, tmp_path / "out.safetensors")


def test_truncated_flat_file_is_refused(tmp_path, flat):
    flat.write_bytes(flat.read_bytes()[:-10])
    with pytest.raises(SourceError, match="truncated"):
        restore_checkpoint(flat, tmp_path / "out.safetensors")


def test_missing_rank_file_is_refused(tmp_path, sharded):
    (sharded / "rank-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match="rank 2's file rank-00002-of-00004.safetensors is"):
        restore_checkpoint(sharded, tmp_path / "out.safetensors")


def test_mismatched_rank_layouts_are_refused(tmp_path, sharded):
    other = tmp_path / "other"
    convert_checkpoint(
        sample("cnn.safetensors"),
        other,
        LayoutOptions(filters=["name:features.0.*"], world_size=4),
        sharded=True,
    )
    shutil.copy(other / "rank-00001-of-00004.safetensors", sharded)
    with pytest.raises(CheckpointError, match="rank 1's file .* different layout than the index"):
        reshard_checkpoint(sharded, tmp_path / "out.safetensors", world_size=2)


def test_rank_file_from_another_conversion_is_refused(tmp_path, sharded):
    header, data = read_header(sharded / "rank-00003-of-00004.safetensors")
    data = bytearray(data)
    a, _ = header["__flat__.float32"]["data_offsets"]
    data[a] ^= 0xFF  # other weights, resealed: consistent in itself
    target = sharded / "rank-00003-of-00004.safetensors"
    write_raw(target, reseal(header, bytes(data)), bytes(data))
    with pytest.raises(CheckpointError, match="does not match the index's checksums for rank 3"):
        restore_checkpoint(sharded, tmp_path / "out.safetensors")


def test_rank_files_out_of_place_are_refused(tmp_path, sharded):
    a, b = (sharded / f"rank-0000{r}-of-00004.safetensors" for r in (0, 1))
    tmp = tmp_path / "swap"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    with pytest.raises(CheckpointError, match="is not rank 0 of this set"):
        restore_checkpoint(sharded, tmp_path / "out.safetensors")


def test_damaged_index_is_refused(tmp_path, sharded):
    index = json.loads((sharded / INDEX_NAME).read_text())
    index["ranks"].pop()
    (sharded / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists 3 ranks for world size 4"):
        restore_checkpoint(sharded, tmp_path / "out.safetensors")


def test_a_rank_file_alone_or_a_plain_file_is_refused(tmp_path, sharded):
    with pytest.raises(CheckpointError, match="is rank 0 of a sharded set of 4; give its folder"):
        restore_checkpoint(sharded / "rank-00000-of-00004.safetensors", tmp_path / "o.safetensors")
    with pytest.raises(CheckpointError, match="is not a yafsdp flat checkpoint"):
        restore_checkpoint(sample("mlp.safetensors"), tmp_path / "o.safetensors")
    with pytest.raises(CheckpointError, match="a folder without yafsdp.index.json"):
        reshard_checkpoint(tmp_path, tmp_path / "o.safetensors", world_size=2)


def test_converting_a_flat_checkpoint_is_refused(tmp_path, flat):
    with pytest.raises(CheckpointError, match="already a flat-buffer checkpoint; use `yafsdp"):
        convert_checkpoint(flat, tmp_path / "again.safetensors")


def test_existing_output_needs_force(tmp_path, flat):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="exists; pass --force"):
        restore_checkpoint(flat, out)
    assert out.read_bytes() == b"keep me"
    restore_checkpoint(flat, out, force=True)
    assert out.stat().st_size > 1000


def test_output_equal_to_the_input_is_refused(tmp_path, flat, sharded):
    before = flat.read_bytes()
    with pytest.raises(CheckpointError, match="is the input"):
        reshard_checkpoint(flat, flat, world_size=2, force=True)
    with pytest.raises(CheckpointError, match="is the input"):
        restore_checkpoint(flat, flat.parent / "." / flat.name, force=True)
    with pytest.raises(CheckpointError, match=r"is the input .* \(or holds it\)"):
        reshard_checkpoint(sharded, sharded, world_size=2, sharded=True, force=True)
    src = tmp_path / "src.safetensors"
    shutil.copy(sample("mlp.safetensors"), src)
    with pytest.raises(CheckpointError, match="is the input"):
        convert_checkpoint(src, src, force=True)
    assert flat.read_bytes() == before


def test_a_folder_that_is_not_a_set_is_never_replaced(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="not a yafsdp sharded checkpoint .* even with"):
        convert_checkpoint(
            sample("mlp.safetensors"),
            tmp_path / "mine",
            LayoutOptions(world_size=2),
            sharded=True,
            force=True,
        )
    assert listing(tmp_path / "mine") == ["notes.txt"]


def test_bad_output_names_are_refused(tmp_path, flat):
    with pytest.raises(CheckpointError, match="a flat checkpoint is a .safetensors file"):
        convert_checkpoint(sample("mlp.safetensors"), tmp_path / "out.bin")
    with pytest.raises(CheckpointError, match="with --sharded the output is a folder"):
        reshard_checkpoint(flat, tmp_path / "set.safetensors", world_size=2, sharded=True)
    with pytest.raises(CheckpointError, match=r"give a .safetensors file \(or .pt"):
        restore_checkpoint(flat, tmp_path / "out.npz")


class InjectedError(Exception):
    pass


def failing_after(calls: int, exc=InjectedError):
    seen = []

    def progress(phase, done, total):
        if phase != "writing":
            return
        seen.append(done)
        if len(seen) > calls:
            raise exc("injected")

    return progress


@pytest.mark.parametrize("exc", [InjectedError, KeyboardInterrupt])
@pytest.mark.parametrize("sharded_out", [False, True])
def test_failure_mid_write_leaves_nothing(tmp_path, exc, sharded_out):
    out = tmp_path / ("set" if sharded_out else "flat.safetensors")
    with pytest.raises(exc):
        convert_checkpoint(
            sample("gpt.safetensors"),
            out,
            LayoutOptions(world_size=3),
            sharded=sharded_out,
            progress=failing_after(5, exc),
        )
    assert listing(tmp_path) == []


def test_failure_mid_write_keeps_the_old_output(tmp_path, flat):
    out = tmp_path / "set"
    reshard_checkpoint(flat, out, world_size=2, sharded=True)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InjectedError):
        reshard_checkpoint(
            flat, out, world_size=3, sharded=True, force=True, progress=failing_after(2)
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert listing(tmp_path) == ["flat.safetensors", "set"]


def test_failed_verify_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_mod, "equal_streams", lambda a, b: False)
    out = tmp_path / "flat.safetensors"
    result = convert_checkpoint(sample("mlp.safetensors"), out, verify=True)
    assert not result.written and not result.verify.ok
    assert len(result.verify.mismatches) == 6
    assert listing(tmp_path) == []


def test_every_error_is_a_yafsdp_error():
    assert issubclass(CheckpointError, YafsdpError)


def test_kept_copies_that_differ_between_ranks_are_refused(tmp_path, sharded):
    rank1 = sharded / "rank-00001-of-00004.safetensors"
    header, data = read_header(rank1)
    data = bytearray(data)
    a, _ = header["features.1.num_batches_tracked"]["data_offsets"]
    data[a] ^= 0x01
    header = reseal(header, bytes(data))
    write_raw(rank1, header, bytes(data))
    index = json.loads((sharded / INDEX_NAME).read_text())  # forged consistently
    index["ranks"][1]["checksums"] = json.loads(header["__metadata__"]["yafsdp.checksums"])
    (sharded / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="kept tensor 'features.1.num_batches_tracked' diff"):
        restore_checkpoint(sharded, tmp_path / "out.safetensors")
