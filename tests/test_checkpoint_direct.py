"""Long ranges split between the kernel copy and O_DIRECT writes (checkpoint/direct.py)."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from pathlib import Path

import pytest
from checkpoint_helpers import file_system_can, sample
from hypothesis import given, settings
from hypothesis import strategies as st

from yafsdp_cli.checkpoint import convert_checkpoint, direct, reshard_checkpoint, restore_checkpoint
from yafsdp_cli.checkpoint.copy import Copier, FileRange
from yafsdp_cli.checkpoint.format import Checksum
from yafsdp_cli.errors import CheckpointError

KiB, MiB = 1024, 1024 * 1024


def _direct_works(folder: Path) -> bool:
    def write_direct(path: Path) -> None:
        fd = direct.open_direct(path)
        if fd is None:
            raise OSError(errno.EINVAL, "O_DIRECT refused at open")
        try:
            os.pwrite(fd, mmap.mmap(-1, direct.ALIGN), 0)
        finally:
            os.close(fd)

    return file_system_can(folder, write_direct)


@pytest.fixture
def small_chunks(tmp_path, monkeypatch):
    """64 KiB chunks, so that a 3 MiB file is dozens of them; skipped where the
    file system has no O_DIRECT (tmpfs), with the reason."""
    if not _direct_works(tmp_path):
        pytest.skip(f"{tmp_path}: this file system refuses O_DIRECT writes")
    monkeypatch.setattr(direct, "CHUNK", 64 * KiB)


def _source(tmp_path: Path, n: int = 3 * MiB + 123) -> tuple[Path, bytes]:
    data = os.urandom(n)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return path, data


def _split_copy(copier: Copier, src: FileRange, dst: Path, at: int, size: int, digest=None):
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, size)
        copier.copy(src, fd, at, digest, None, dst)
    finally:
        os.close(fd)
    return dst.read_bytes()


def _fail_direct_writes(monkeypatch, code: int) -> None:
    """Every write through an O_DIRECT descriptor fails with ``code``."""
    import fcntl

    real = os.pwrite

    def pwrite(fd, buf, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT:
            raise OSError(code, os.strerror(code))
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", pwrite)


# ------------------------------------------------------------------ the plan


@settings(max_examples=200, deadline=None)
@given(
    src_off=st.integers(0, 3 * direct.ALIGN),
    dst_off=st.integers(0, 3 * direct.ALIGN),
    sizes=st.lists(st.tuples(st.integers(1, 5 * direct.CHUNK), st.booleans()), max_size=4),
)
def test_the_plan_covers_every_byte_once_and_direct_chunks_are_aligned(src_off, dst_off, sizes):
    segments, pos = [], src_off
    for n, is_data in sizes:
        segments.append((pos, n, is_data))
        pos += n
    chunks = direct.plan(segments, src_off, dst_off)
    at = src_off
    for c in chunks:  # in order, no gap, no overlap; output offset follows the source's
        assert c.src == at and c.dst == dst_off + c.src - src_off and c.nbytes > 0
        at += c.nbytes
        if c.direct:
            assert c.dst % direct.ALIGN == 0 and c.nbytes % direct.ALIGN == 0
            assert c.nbytes <= direct.CHUNK
        elif not c.hole:
            assert c.nbytes < direct.ALIGN  # an unaligned head or tail
    assert at == pos
    assert sum(c.nbytes for c in chunks if c.hole) == sum(n for n, d in sizes if not d)


def test_a_page_of_the_output_is_never_written_both_ways():
    chunks = direct.plan([(0, 10 * direct.ALIGN + 17, True)], 0, 5)
    direct_pages = {p for c in chunks if c.direct for p in _pages(c)}
    kernel_pages = {p for c in chunks if not c.direct and not c.hole for p in _pages(c)}
    assert direct_pages and kernel_pages and not direct_pages & kernel_pages


def _pages(c: direct.Chunk) -> range:
    return range(c.dst // direct.ALIGN, (c.dst + c.nbytes - 1) // direct.ALIGN + 1)


# ------------------------------------------------------------------ choosing the way


def test_the_faster_way_takes_the_chunks_and_the_other_is_timed_again_less_often():
    r = direct.Rates()
    assert r.choose() == ("kernel", True)  # first: the kernel copy, timed
    r.note("kernel", 1.0, 100)
    assert r.choose() == ("direct", True)  # then one direct write, timed
    r.note("direct", 1.0, 100, retime=True)  # as fast: the kernel copy keeps the lead,
    every = 2 * direct.RETIME_EVERY  # and direct writes are timed again half as often
    assert r.retime_every == every
    ways = [r.choose()[0] for _ in range(every)]
    assert ways == ["kernel"] * (every - 1) + ["direct"]
    r.note("direct", 1.0, 100, retime=True)
    assert r.retime_every == 2 * every
    r.retime_every = direct.RETIME_MAX
    r.note("direct", 1.0, 100, retime=True)
    assert r.retime_every == direct.RETIME_MAX  # no more than that
    r.note("kernel", 30.0, 100)  # the page cache became slow
    assert r.best() == "direct"
    assert r.choose() == ("direct", False)


def test_direct_writes_take_over_only_from_a_much_slower_kernel_copy():
    r = direct.Rates()
    r.note("kernel", 1.0, 100)
    r.note("direct", 0.9 / direct.DIRECT_MARGIN * 2, 100)  # faster, not by the margin
    assert r.best() == "kernel"
    r.note("kernel", 10.0, 100)
    assert r.best() == "direct"


# ------------------------------------------------------------------ copying


@pytest.mark.parametrize("mode", ["direct", "kernel", None])
@pytest.mark.parametrize("at", [0, 7, direct.ALIGN])
def test_every_way_copies_the_same_bytes_and_crc(tmp_path, small_chunks, mode, at):
    src, data = _source(tmp_path)
    copier, digest = Copier(record=True), Checksum()
    copier.split_mode = mode
    where = FileRange(src, 3, len(data) - 3)
    out = _split_copy(copier, where, tmp_path / "d", at, len(data) + at + 1, digest)
    assert out[at : at + len(data) - 3] == data[3:] and out[:at] == bytes(at)
    assert digest.text() == f"crc32:{zlib.crc32(data[3:]):08x}"
    assert copier.ledger.get(where) == zlib.crc32(data[3:])  # the input check reuses it
    if mode == "direct":
        assert copier.used["direct"] > 0.9 * len(data)
    if mode == "kernel":
        assert "direct" not in copier.used
    assert not [t for t in threading.enumerate() if t.name == "yafsdp-direct"]


def test_holes_of_a_sparse_source_stay_holes_and_count_as_zeros(tmp_path, small_chunks):
    src, size = tmp_path / "sparse.bin", 8 * MiB
    payload = os.urandom(MiB + 5)
    with open(src, "wb") as f:
        f.truncate(size)
        f.seek(3 * MiB)
        f.write(payload)
    if os.stat(src).st_blocks * 512 > 4 * MiB:
        pytest.skip("this file system does not keep holes")
    copier, digest = Copier(), Checksum()
    copier.split_mode = "direct"
    dst = tmp_path / "d"
    out = _split_copy(copier, FileRange(src, 0, size), dst, 0, size, digest)
    assert out[3 * MiB : 3 * MiB + len(payload)] == payload
    assert out.count(0) >= size - len(payload)
    assert digest.text() == f"crc32:{zlib.crc32(out):08x}"
    assert os.stat(dst).st_blocks * 512 < 4 * MiB  # the hole was not written


def test_without_o_direct_at_open_the_kernel_copies_and_it_is_not_asked_again(
    tmp_path, small_chunks, monkeypatch
):
    src, data = _source(tmp_path)
    asked = []

    def refuse(path):
        asked.append(path)
        return None

    monkeypatch.setattr(direct, "open_direct", refuse)
    copier = Copier()
    for name in ("d", "e"):
        out = _split_copy(copier, FileRange(src, 0, len(data)), tmp_path / name, 7, len(data) + 7)
        assert out[7:] == data
    assert len(asked) == 1 and not copier.direct and "direct" not in copier.used


def test_a_refused_direct_write_is_copied_the_kernels_way(tmp_path, small_chunks, monkeypatch):
    """tmpfs and some network file systems open with O_DIRECT, then refuse the write."""
    src, data = _source(tmp_path)
    _fail_direct_writes(monkeypatch, errno.EINVAL)
    copier, digest = Copier(), Checksum()
    copier.split_mode = "direct"
    out = _split_copy(
        copier, FileRange(src, 0, len(data)), tmp_path / "d", 7, len(data) + 7, digest
    )
    assert out[7:] == data and digest.text() == f"crc32:{zlib.crc32(data):08x}"
    assert not copier.direct and "direct" not in copier.used


def test_a_full_disk_in_a_direct_write_is_the_outputs_error(tmp_path, small_chunks, monkeypatch):
    src, data = _source(tmp_path)
    _fail_direct_writes(monkeypatch, errno.ENOSPC)
    copier = Copier()
    copier.split_mode = "direct"
    with pytest.raises(OSError) as info:
        _split_copy(copier, FileRange(src, 0, len(data)), tmp_path / "d", 7, len(data) + 7)
    assert info.value.errno == errno.ENOSPC
    assert not [t for t in threading.enumerate() if t.name == "yafsdp-direct"]


def test_a_full_disk_in_a_direct_write_leaves_no_output(tmp_path, small_chunks, monkeypatch):
    _fail_direct_writes(monkeypatch, errno.ENOSPC)
    monkeypatch.setattr(direct, "SPLIT_MIN", 1)
    out = tmp_path / "out" / "flat.safetensors"
    out.parent.mkdir()
    with pytest.raises(CheckpointError, match=r"no space left on device while writing .*out"):
        convert_checkpoint(sample("gpt.safetensors"), out, world_size=2)
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("where", ["read back", "direct read"])
def test_a_read_error_in_the_worker_or_here_is_the_sources(
    tmp_path, small_chunks, monkeypatch, where
):
    src, data = _source(tmp_path)
    real, calls = os.preadv, []

    def preadv(fd, bufs, off):
        calls.append(threading.current_thread().name)
        if (where == "read back") == (threading.current_thread().name == "yafsdp-direct"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    copier = Copier()
    copier.split_mode = "kernel" if where == "read back" else "direct"
    with pytest.raises(CheckpointError, match=r"src.bin: cannot read \(Input/output error\)"):
        _split_copy(
            copier, FileRange(src, 0, len(data)), tmp_path / "d", 7, len(data) + 7, Checksum()
        )
    assert not [t for t in threading.enumerate() if t.name == "yafsdp-direct"]


def test_a_source_truncated_meanwhile_is_reported_truncated(tmp_path, small_chunks, monkeypatch):
    src, data = _source(tmp_path)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: 0)
    copier = Copier()
    copier.split_mode = "direct"
    with pytest.raises(CheckpointError, match="truncated file"):
        _split_copy(
            copier, FileRange(src, 0, len(data)), tmp_path / "d", 7, len(data) + 7, Checksum()
        )


def test_ctrl_c_during_the_split_copy_ends_the_worker(tmp_path, small_chunks, monkeypatch):
    src, data = _source(tmp_path)
    real, copies = os.copy_file_range, []

    def interrupted(*args):
        copies.append(1)
        if len(copies) > 3:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", interrupted)
    copier = Copier()
    copier.split_mode = "kernel"
    with pytest.raises(KeyboardInterrupt):
        _split_copy(
            copier, FileRange(src, 0, len(data)), tmp_path / "d", 7, len(data) + 7, Checksum()
        )
    assert not [t for t in threading.enumerate() if t.name == "yafsdp-direct"]


# ------------------------------------------------------------------ whole commands


@pytest.mark.parametrize("mode", ["direct", "kernel", None])
def test_commands_write_the_same_bytes_whichever_way_chunks_go(
    tmp_path, small_chunks, monkeypatch, mode
):
    """convert, restore and reshard through the split copy, every chunk one way or
    the other or as the rates say, equal the files written without it."""
    monkeypatch.setattr(direct, "SPLIT_MIN", 1)
    outputs, real_init = {}, Copier.__init__
    for label, split in (("plain", False), ("split", True)):

        def init(self, *a, _split=split, **k):
            real_init(self, *a, **k)
            self.direct = _split
            self.split_mode = mode

        monkeypatch.setattr(Copier, "__init__", init)
        d = tmp_path / label
        d.mkdir()
        convert_checkpoint(sample("llama.safetensors"), d / "flat.safetensors", world_size=4)
        restore_checkpoint(d / "flat.safetensors", d / "restored.safetensors")
        reshard_checkpoint(d / "flat.safetensors", d / "sharded", world_size=3, sharded=True)
        outputs[label] = {
            p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
        }
        monkeypatch.setattr(Copier, "__init__", real_init)
    assert outputs["plain"] == outputs["split"] and len(outputs["plain"]) >= 5
