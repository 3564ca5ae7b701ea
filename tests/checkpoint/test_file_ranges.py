"""Copying by file ranges: the kernel paths and their fallbacks, holes, checksums."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import zlib
from pathlib import Path

import pytest
from checkpoint_helpers import (
    assert_same_tensors,
    file_system_can,
    load_st,
    read_header,
    reseal,
    sample,
    write_raw,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from yafsdp_cli.checkpoint import (
    convert_checkpoint,
    file_ranges,
    reshard_checkpoint,
    restore_checkpoint,
)
from yafsdp_cli.checkpoint import crc as crc_mod
from yafsdp_cli.checkpoint.file_ranges import Copier, FileRange, Zeros, coalesce, data_segments
from yafsdp_cli.checkpoint.format import Checksum
from yafsdp_cli.errors import CheckpointError
from yafsdp_cli.options import LayoutOptions

MiB = 1024 * 1024


# ------------------------------------------------------------------ checksums


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 1 << 20), crc=st.integers(0, 0xFFFFFFFF))
def test_crc_of_zeros_equals_zlib_over_real_zeros(n, crc):
    assert crc_mod.crc32_zeros(crc, n) == zlib.crc32(bytes(n), crc)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=5000), crc=st.integers(0, 0xFFFFFFFF))
def test_fast_crc_is_zlibs_crc(data, crc):
    assert crc_mod.crc32(data, crc) == zlib.crc32(data, crc)


def test_zlib_fallback_writes_the_same_file_byte_for_byte(tmp_path, monkeypatch):
    """Without isal the same CRC-32 comes from zlib: files do not depend on it."""
    fast = tmp_path / "fast.safetensors"
    convert_checkpoint(sample("llama.safetensors"), fast, LayoutOptions(world_size=4))
    monkeypatch.setattr(crc_mod, "_fast_crc32", None)
    assert crc_mod.backend() == "zlib"
    slow = tmp_path / "slow.safetensors"
    convert_checkpoint(sample("llama.safetensors"), slow, LayoutOptions(world_size=4))
    assert fast.read_bytes() == slow.read_bytes()
    restore_checkpoint(fast, tmp_path / "r.safetensors")  # zlib verifies isal's sums


def test_sha256_digest_extends_over_zeros_like_real_zeros():
    a, b = Checksum("sha256"), Checksum("sha256")
    a.update(b"x")
    a.update_zeros(300_000)
    b.update(b"x" + bytes(300_000))
    assert a.text() == b.text()


# ------------------------------------------------------------------ pieces


def test_coalesce_merges_neighbouring_ranges_and_zeros_only():
    a, b = Path("a"), Path("b")
    pieces = [
        FileRange(a, 0, 10),
        FileRange(a, 10, 5),  # continues a
        FileRange(a, 20, 5),  # a gap: new range
        FileRange(b, 25, 5),  # another file
        Zeros(3),
        Zeros(4),
        FileRange(b, 0, 0),  # empty: dropped
        FileRange(b, 30, 2),
    ]
    assert list(coalesce(pieces)) == [
        FileRange(a, 0, 15),
        FileRange(a, 20, 5),
        FileRange(b, 25, 5),
        Zeros(7),
        FileRange(b, 30, 2),
    ]


def test_coalesce_passes_bytes_on_before_reading_the_next_chunk():
    """A stream may reuse one buffer: each chunk must be used before the next."""
    buf = bytearray(4)

    def stream():
        for v in (1, 2, 3):
            buf[:] = bytes([v]) * 4
            yield memoryview(buf)

    seen = [bytes(c) for c in coalesce(stream())]
    assert seen == [b"\x01" * 4, b"\x02" * 4, b"\x03" * 4]


# ------------------------------------------------------------------ copying


def _source(tmp_path: Path, n: int = 3 * MiB + 123) -> tuple[Path, bytes]:
    data = os.urandom(n)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return path, data


def _copy(copier: Copier, src: FileRange, dst: Path, size: int, digest=None) -> bytes:
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, size)
        copier.copy(src, fd, 7, digest)
    finally:
        os.close(fd)
    return dst.read_bytes()


def _fail(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


def test_plain_copy_uses_copy_file_range(tmp_path):
    src, data = _source(tmp_path)
    copier = Copier()
    out = _copy(copier, FileRange(src, 100, len(data) - 200), tmp_path / "d", len(data))
    assert out[7 : 7 + len(data) - 200] == data[100:-100] and out[:7] == bytes(7)
    assert set(copier.used) == {"copy_file_range"}


@pytest.mark.parametrize("code", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL])
def test_copy_file_range_refused_falls_back_to_sendfile(tmp_path, monkeypatch, code):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "copy_file_range", _fail(code))
    copier = Copier()
    out = _copy(copier, FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7)
    assert out[7:] == data
    assert set(copier.used) == {"sendfile"} and "copy_file_range" in copier.disabled


def test_both_kernel_copies_refused_fall_back_to_buffered_reads(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "copy_file_range", _fail(errno.EXDEV))
    monkeypatch.setattr(os, "sendfile", _fail(errno.EINVAL))
    copier = Copier(buffer_bytes=MiB)
    out = _copy(copier, FileRange(src, 5, len(data) - 5), tmp_path / "d", len(data) + 2)
    assert out[7:] == data[5:]
    assert set(copier.used) == {"buffered"}
    assert copier.disabled == {"copy_file_range", "sendfile"}


def test_a_kernel_copy_that_stops_short_is_finished_by_the_next_method(tmp_path, monkeypatch):
    """Some file systems answer 0 instead of failing; the rest must still arrive."""
    src, data = _source(tmp_path)
    real = os.copy_file_range
    calls = []

    def once_then_zero(*args):
        calls.append(1)
        return real(args[0], args[1], min(args[2], 1000), *args[3:]) if len(calls) == 1 else 0

    monkeypatch.setattr(os, "copy_file_range", once_then_zero)
    copier = Copier()
    out = _copy(copier, FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7)
    assert out[7:] == data
    assert copier.used["copy_file_range"] == 1000 and copier.used["sendfile"] == len(data) - 1000


@pytest.mark.parametrize("method", ["copy_file_range", "sendfile"])
def test_a_kernel_copy_reaches_the_64k_grid_in_its_first_call(tmp_path, monkeypatch, method):
    """The kernel writes a copy 64 KiB at a time, each write into folios no larger than
    its offset's alignment allows: the first call ends on the output's next 64 KiB
    boundary and every later call starts on one (``copy_methods``, "output 8 KiB in":
    the same copy without that first short call takes 1.37x as long)."""
    src, data = _source(tmp_path)
    monkeypatch.setattr(file_ranges, "KERNEL_STEP", 4 * file_ranges.WRITE_ALIGN)  # several calls
    real, starts = getattr(os, method), []
    if method == "copy_file_range":

        def spy(fd_in, fd_out, n, off_in, off_out):
            starts.append(off_out)
            return real(fd_in, fd_out, n, off_in, off_out)

    else:
        monkeypatch.setattr(os, "copy_file_range", _fail(errno.EXDEV))

        def spy(fd_out, fd_in, off_in, n):
            starts.append(os.lseek(fd_out, 0, os.SEEK_CUR))
            return real(fd_out, fd_in, off_in, n)

    monkeypatch.setattr(os, method, spy)
    copier = Copier()
    out = _copy(copier, FileRange(src, 100, len(data) - 100), tmp_path / "d", len(data) + 7)
    assert out[7 : 7 + len(data) - 100] == data[100:] and set(copier.used) == {method}
    grid = file_ranges.WRITE_ALIGN
    assert starts[0] == 7 and starts[1] == grid  # 7 bytes in: up to the boundary first
    assert len(starts) > 3 and all(at % grid == 0 for at in starts[1:])


def test_other_errors_of_the_kernel_copy_are_clear_errors(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "copy_file_range", _fail(errno.EIO))
    with pytest.raises(CheckpointError, match=r"src.bin: copy failed \(Input/output error"):
        _copy(Copier(), FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7)


def test_a_full_disk_in_the_kernel_copy_is_the_outputs_error(tmp_path, monkeypatch):
    """ENOSPC is the output's fault: it reaches ``staged_output`` as an OSError, which
    names the output (not the source the copy read)."""
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "copy_file_range", _fail(errno.ENOSPC))
    _assert_disk_full(src, len(data), tmp_path / "d")


def _assert_disk_full(src: Path, n: int, dst: Path) -> None:
    """Copying all ``n`` bytes of ``src`` raises the OSError ENOSPC itself."""
    with pytest.raises(OSError) as info:
        _copy(Copier(), FileRange(src, 0, n), dst, n + 7)
    assert info.value.errno == errno.ENOSPC


def test_checksummed_copy_is_the_kernel_copy_then_a_read_back(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    read_back = []
    real = Copier.crc_of

    def spy(self, src, visit=None, tick=None):
        read_back.append(src)
        return real(self, src, visit, tick)

    monkeypatch.setattr(Copier, "crc_of", spy)
    copier, digest = Copier(buffer_bytes=MiB), Checksum()
    where = FileRange(src, 3, len(data) - 3)
    out = _copy(copier, where, tmp_path / "d", len(data) + 4, digest)
    assert out[7:] == data[3:]
    assert digest.text() == f"crc32:{zlib.crc32(data[3:]):08x}"
    assert set(copier.used) == {"copy_file_range"} and read_back == [where]


def test_without_kernel_copies_the_checksummed_copy_is_one_buffered_pass(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "copy_file_range", _fail(errno.EXDEV))
    monkeypatch.setattr(os, "sendfile", _fail(errno.EINVAL))
    monkeypatch.setattr(Copier, "crc_of", lambda *a, **k: pytest.fail("read twice"))
    copier, digest = Copier(buffer_bytes=MiB), Checksum()
    copier.disabled.update({"copy_file_range", "sendfile"})  # as after a first refusal
    out = _copy(copier, FileRange(src, 3, len(data) - 3), tmp_path / "d", len(data) + 4, digest)
    assert out[7:] == data[3:]
    assert digest.text() == f"crc32:{zlib.crc32(data[3:]):08x}"
    assert set(copier.used) == {"buffered"}


def test_a_range_past_the_end_of_its_file_is_truncation_not_zeros(tmp_path):
    src, data = _source(tmp_path, 1000)
    with pytest.raises(CheckpointError, match=r"ends at byte 1000, before byte 1001.*truncated"):
        _copy(Copier(), FileRange(src, 1, 1000), tmp_path / "d", 2000, Checksum())


def test_a_file_that_shrinks_mid_copy_is_reported_truncated(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)
    with pytest.raises(CheckpointError, match="truncated file"):
        _copy(Copier(), FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7, Checksum())


# ------------------------------------------------------------------ holes


def _sparse(path: Path, size: int, data_at: int, data: bytes) -> bool:
    """A file of ``size`` bytes, all hole but ``data`` at ``data_at``; False where
    the file system stores the hole as blocks."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(data_at)
        f.write(data)
    return os.stat(path).st_blocks * 512 < size // 2


def test_holes_are_found_and_stay_holes(tmp_path):
    src, size = tmp_path / "sparse.bin", 64 * MiB
    payload = os.urandom(MiB)
    if not _sparse(src, size, 32 * MiB, payload):
        pytest.skip("this file system does not keep holes")
    fd = os.open(src, os.O_RDONLY)
    try:
        segs = list(data_segments(fd, 0, size))
    finally:
        os.close(fd)
    assert sum(n for _, n, _ in segs) == size
    assert any(d for _, _, d in segs) and not segs[0][2]
    copier, digest = Copier(), Checksum()
    dst = tmp_path / "d"
    out = _copy(copier, FileRange(src, 0, size), dst, size + 7, digest)
    assert out[7:] == src.read_bytes()
    assert digest.text() == f"crc32:{zlib.crc32(src.read_bytes()):08x}"
    assert os.stat(dst).st_blocks * 512 < 4 * MiB  # the data block, not the 63 MiB of holes
    assert copier.used["hole"] >= size - 2 * MiB


def test_without_seek_data_everything_is_data(tmp_path, monkeypatch):
    src, data = _source(tmp_path, 5000)
    real = os.lseek

    def no_seek_data(fd, pos, how):
        if how in (os.SEEK_DATA, os.SEEK_HOLE):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, pos, how)

    monkeypatch.setattr(os, "lseek", no_seek_data)
    fd = os.open(src, os.O_RDONLY)
    try:
        assert list(data_segments(fd, 10, 4000)) == [(10, 4000, True)]
    finally:
        os.close(fd)


def _sparse_safetensors(path: Path, numel: int) -> int:
    """A real header for two fp32 tensors, and a hole where their data is."""
    header = {
        "__metadata__": {"format": "pt"},
        "model.layers.0.w": {"dtype": "F32", "shape": [numel], "data_offsets": [0, 4 * numel]},
        "model.layers.1.w": {
            "dtype": "F32",
            "shape": [numel],
            "data_offsets": [4 * numel, 8 * numel],
        },
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 8 * numel)
    return 8 + len(raw) + 8 * numel


def test_sparse_source_converts_to_a_sparse_checkpoint_and_back(tmp_path):
    src = tmp_path / "sparse.safetensors"
    size = _sparse_safetensors(src, 16 * MiB)  # 128 MiB of hole
    if os.stat(src).st_blocks * 512 > MiB:
        pytest.skip("this file system does not keep holes")
    flat, folder = tmp_path / "flat.safetensors", tmp_path / "set"
    info = convert_checkpoint(src, flat, LayoutOptions(world_size=8)).checkpoint
    assert os.stat(flat).st_blocks * 512 < MiB < size
    (buffer,) = info.buffers  # one root buffer: no ModuleList, no units
    zero_sum = f"crc32:{zlib.crc32(bytes(buffer.nbytes)):08x}"
    assert info.files[0].checksums == {buffer.name: zero_sum}
    reshard_checkpoint(flat, folder, world_size=2, sharded=True)
    assert sum(os.stat(p).st_blocks * 512 for p in folder.iterdir()) < MiB
    back = tmp_path / "back.safetensors"
    restore_checkpoint(folder, back)
    assert os.stat(back).st_blocks * 512 < MiB
    with open(src, "rb") as a, open(back, "rb") as b:
        (na,), (nb,) = struct.unpack("<Q", a.read(8)), struct.unpack("<Q", b.read(8))
        a.seek(8 + na)
        b.seek(8 + nb)
        assert a.read() == b.read()  # 128 MiB of zeros, bit for bit


# ------------------------------------------------------------------ end to end


@pytest.mark.parametrize("refuse", [(), ("copy_file_range",), ("copy_file_range", "sendfile")])
def test_round_trips_are_bit_exact_on_every_copy_path(tmp_path, monkeypatch, refuse):
    for name in refuse:
        monkeypatch.setattr(os, name, _fail(errno.EXDEV))
    used: dict[str, int] = {}
    real_count = Copier._count

    def count(self, method, n):
        used[method] = used.get(method, 0) + n
        real_count(self, method, n)

    monkeypatch.setattr(Copier, "_count", count)
    src = sample("cnn.safetensors")  # has a kept tensor (num_batches_tracked, int64)
    flat, folder = tmp_path / "flat.safetensors", tmp_path / "set"
    r = convert_checkpoint(src, flat, LayoutOptions(world_size=3), verify=True)
    assert r.verify.ok and not r.verify.mismatches
    reshard_checkpoint(flat, folder, world_size=4, sharded=True)
    back = tmp_path / "back.safetensors"
    restore_checkpoint(folder, back)
    assert_same_tensors(load_st(src), load_st(back))
    # the first kernel method not refused moves the bytes, else buffered reads
    kernel = [m for m in ("copy_file_range", "sendfile") if m not in refuse]
    assert (kernel[0] if kernel else "buffered") in used
    assert not set(refuse) & set(used)


@pytest.mark.parametrize("where", ["entry", "padding"])
@pytest.mark.parametrize("command", ["restore", "reshard"])
def test_input_checked_in_the_copy_pass_still_refuses_any_changed_byte(tmp_path, command, where):
    """restore/reshard check the input while copying it: an entry byte (copied, its
    CRC from the ledger) or a padding byte (not copied, read by verify) that changed
    is refused, and nothing appears at the output."""
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(
        sample("gpt.safetensors"), flat, LayoutOptions(world_size=4, align="megatron")
    )
    header, data = read_header(flat)
    layout = json.loads(header["__metadata__"]["yafsdp.layout"])
    buf = next(b for b in layout["buffers"] if b["padded_numel"] > b["end"])
    a, _ = header[buf["name"]]["data_offsets"]
    data = bytearray(data)
    data[a + (buf["end"] * 4 if where == "padding" else 100)] ^= 0x20
    write_raw(flat, reseal(header, bytes(data)) if where == "padding" else header, bytes(data))
    out = tmp_path / "out"
    message = "is not zero" if where == "padding" else "fails its checksum"
    with pytest.raises(CheckpointError, match=rf"buffer '{re.escape(buf['name'])}' .*{message}"):
        if command == "restore":
            restore_checkpoint(flat, out.with_suffix(".safetensors"))
        else:
            reshard_checkpoint(flat, out, world_size=2, sharded=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat.safetensors"]


def test_disk_full_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(file_ranges.os, "pwrite", _fail(errno.ENOSPC))
    out = tmp_path / "out" / "flat.safetensors"
    out.parent.mkdir()
    with pytest.raises(CheckpointError, match=r"no space left on device while writing .*out"):
        convert_checkpoint(sample("llama.safetensors"), out, LayoutOptions(world_size=2))
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("command", ["restore", "reshard"])
def test_the_input_is_read_once(tmp_path, monkeypatch, command):
    """Each input byte enters this process once: the CRC read back after the kernel
    copy serves the input check too, which then reads only what was not copied."""
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(sample("gpt.safetensors"), flat, LayoutOptions(world_size=4))
    reread: list[int] = []
    real = Copier.hash

    def spy(self, src, digest, visit=None, tick=None):
        reread.append(src.nbytes)
        real(self, src, digest, visit, tick)

    monkeypatch.setattr(Copier, "hash", spy)
    if command == "restore":
        restore_checkpoint(flat, tmp_path / "r.safetensors")
    else:
        reshard_checkpoint(flat, tmp_path / "s.safetensors", world_size=3)
    header, data = read_header(flat)
    assert len(data) <= sum(reread) < len(data) * 1.02, (sum(reread), len(data))


def test_the_read_back_thread_gives_the_crc_and_hands_its_errors_over(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(file_ranges, "OVERLAP_MIN", 1)  # every range: copy and read back at once
    digest = Checksum()
    out = _copy(
        Copier(buffer_bytes=MiB),
        FileRange(src, 0, len(data)),
        tmp_path / "d",
        len(data) + 7,
        digest,
    )
    assert out[7:] == data and digest.text() == f"crc32:{zlib.crc32(data):08x}"
    monkeypatch.setattr(os, "preadv", _fail(errno.EIO))  # the reading thread fails
    with pytest.raises(CheckpointError, match=r"src.bin: cannot read \(Input/output error\)"):
        _copy(Copier(), FileRange(src, 0, len(data)), tmp_path / "e", len(data) + 7, Checksum())


def test_ctrl_c_during_the_kernel_copy_stops_the_read_back_thread(tmp_path, monkeypatch):
    import threading

    src, data = _source(tmp_path)
    monkeypatch.setattr(file_ranges, "OVERLAP_MIN", 1)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "copy_file_range", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _copy(Copier(), FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7, Checksum())
    assert not [t for t in threading.enumerate() if t.name == "yafsdp-crc"]


# ------------------------------------------------------------------ reserving output blocks


def _can_allocate(folder: Path) -> bool:
    def allocate(path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            file_ranges.allocate(fd, 0, MiB)
        finally:
            os.close(fd)

    return file_system_can(folder, allocate)


def test_output_blocks_are_allocated_before_the_kernel_copy_writes_them(tmp_path, monkeypatch):
    if not _can_allocate(tmp_path):
        pytest.skip("this file system has no fallocate")
    src, data = _source(tmp_path)
    dst = tmp_path / "d"
    real, seen = os.copy_file_range, []

    def spy(fd_in, fd_out, n, off_in, off_out):
        seen.append(os.fstat(fd_out).st_blocks * 512)
        return real(fd_in, fd_out, n, off_in, off_out)

    monkeypatch.setattr(os, "copy_file_range", spy)
    copier = Copier()
    out = _copy(copier, FileRange(src, 0, len(data)), dst, len(data) + 7, Checksum())
    assert out[7:] == data and copier.reserve
    assert seen and seen[0] >= len(data)  # every block there before the first byte
    assert os.stat(dst).st_size == len(data) + 7  # the size is the writer's, unchanged


def test_a_full_disk_when_reserving_is_the_outputs_error_before_any_copy(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(file_ranges, "allocate", _fail(errno.ENOSPC))
    monkeypatch.setattr(os, "copy_file_range", lambda *a: pytest.fail("copied anyway"))
    _assert_disk_full(src, len(data), tmp_path / "d")


def test_without_fallocate_the_copy_goes_on_and_does_not_ask_again(tmp_path, monkeypatch):
    src, data = _source(tmp_path)
    asked = []

    def refuse(*args):
        asked.append(args)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(file_ranges, "allocate", refuse)
    copier = Copier()
    for name in ("d", "e"):
        out = _copy(copier, FileRange(src, 0, len(data)), tmp_path / name, len(data) + 7)
        assert out[7:] == data
    assert len(asked) == 1 and not copier.reserve


def test_small_pieces_are_not_reserved(tmp_path, monkeypatch):
    src, data = _source(tmp_path, file_ranges.RESERVE_MIN - 1)
    monkeypatch.setattr(file_ranges, "allocate", lambda *a: pytest.fail("reserved"))
    assert _copy(Copier(), FileRange(src, 0, len(data)), tmp_path / "d", len(data) + 7)[7:] == data


# ------------------------------------------------------------------ page-aligned copies


def _data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_big_flat_file_starts_its_data_where_the_source_does_within_a_page(
    tmp_path, monkeypatch, sharded
):
    """The header is padded with spaces so that every copied range lies at the same
    page offset in the output as in the input; the files still read as before, by
    yafsdp and by the safetensors library, and restore gives the tensors back."""
    import yafsdp_cli.checkpoint.writer as writer_mod

    monkeypatch.setattr(writer_mod, "PAGE_ALIGN_MIN", 0)  # the samples are small
    src = sample("llama.safetensors")
    phase = _data_start(src) % 4096
    out = tmp_path / ("set" if sharded else "flat.safetensors")
    convert_checkpoint(src, out, LayoutOptions(world_size=4), sharded=sharded, verify=True)
    files = sorted(out.glob("*.safetensors")) if sharded else [out]
    assert files and {_data_start(f) % 4096 for f in files} == {phase}
    for f in files:
        header, _ = read_header(f)  # the spaces are JSON whitespace
        assert header["__metadata__"]["yafsdp.format"]
        load_st(f)  # and safetensors itself accepts them
    again = tmp_path / "again.safetensors"
    reshard_checkpoint(out, again, world_size=3)
    direct = tmp_path / "direct.safetensors"
    convert_checkpoint(src, direct, LayoutOptions(world_size=3))
    assert _data_start(again) % 4096 == phase
    assert again.read_bytes() == direct.read_bytes()  # as a direct conversion
    back = tmp_path / "back.safetensors"
    restore_checkpoint(again, back)
    assert _data_start(back) % 4096 == phase  # restore follows its input's too
    assert_same_tensors(load_st(src), load_st(back))


def test_restore_gives_back_the_bytes_safetensors_wrote_whatever_the_padding(tmp_path, monkeypatch):
    """A file saved as transformers saves it (safetensors, `format: pt`): its flat file
    starts its data at the same page offset, so restoring it needs no padding, and
    the restored file is the original's bytes."""
    from safetensors.torch import save_file

    import yafsdp_cli.checkpoint.writer as writer_mod

    monkeypatch.setattr(writer_mod, "PAGE_ALIGN_MIN", 0)
    src = tmp_path / "model.safetensors"
    save_file(load_st(sample("llama.safetensors")), str(src), metadata={"format": "pt"})
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back.safetensors"
    convert_checkpoint(src, flat, LayoutOptions(world_size=4))
    restore_checkpoint(flat, back)
    assert back.read_bytes() == src.read_bytes()


def test_a_small_flat_file_is_not_padded(tmp_path):
    """Up to a page of padding pays only where the copy is long: a small file's data
    starts at the next multiple of 8, as safetensors writes it."""
    src = sample("llama.safetensors")
    out = tmp_path / "flat.safetensors"
    convert_checkpoint(src, out, LayoutOptions(world_size=4))
    header_len = _data_start(out) - 8
    raw = out.read_bytes()[8 : 8 + header_len]
    assert header_len % 8 == 0 and len(raw) - len(raw.rstrip(b" ")) < 8
