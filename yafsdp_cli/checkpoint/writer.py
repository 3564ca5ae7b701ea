"""Streaming safetensors writer and all-or-nothing outputs.

``FileWriter`` writes one safetensors file front to back without holding any
tensor: the header goes first (every offset is known from the slots), with
fixed-width placeholder checksums, and the file is sized whole at once, so that
zeros (padding) are skipped rather than written and read back as zeros (holes
where the file system has them); each tensor's pieces (``copy.py``: file ranges,
zeros, bytes) then follow in data order, hashed on the way; ``finish()`` rewrites
the header in place with the real checksums (same length by construction).

Given the source's ``page_phase`` (where its data starts within a 4 KiB page), a
file with enough data pads its header with spaces (which safetensors allows) so
that its own data starts at the same place in a page: tensor sizes are mostly whole
pages, so each copied range then lies at the same page offset in both files, and
the kernel copies whole pages, about 1.5x faster than shifted ones
(``python -m benchmarks.run copy_methods``).

``staged_output`` makes a command's output appear whole or not at all: data goes
to a hidden temporary file (or folder) beside the target, renamed over it at the
end; on any error, Ctrl-C included, the temporary is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..engine import dtypes
from ..errors import CheckpointError
from ..fileio import write_error
from .copy import Copier, FileRange, Zeros, coalesce, size_of, write_at
from .format import INDEX_NAME, KEY_CHECKSUMS, Checksum, TensorSlot, data_order, placeholder

PAGE = 4096
PAGE_ALIGN_MIN = 64 * 1024 * 1024  # data this long is worth up to a page of padding


def page_phase(paths: Sequence[Path]) -> int | None:
    """Where the data of the first safetensors file among ``paths`` starts within a
    page (``FileWriter``'s ``page_phase``); None when there is none to follow."""
    for path in paths:
        if Path(path).suffix != ".safetensors":
            continue
        try:
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError:
            return None  # the reader reports it
        return (8 + struct.unpack("<Q", head)[0]) % PAGE if len(head) == 8 else None
    return None


class FileWriter:
    """One safetensors file; tensors must be written in ``slots`` order.

    The file handle is opened on demand and may be ``suspend()``-ed between
    tensors, so that a set of thousands of rank files needs one descriptor.
    """

    def __init__(
        self,
        path: Path,
        slots: Sequence[TensorSlot],
        metadata: dict[str, str],
        *,
        checksums: bool = True,
        page_phase: int | None = None,
    ):
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{path}: two tensors with one name in {names}")
        self.path = path
        self.slots = list(slots)
        self.metadata = dict(metadata)
        self.with_checksums = checksums
        self.checksums: dict[str, str] = {}
        self._padded_len: int | None = None
        header = self._header({s.name: placeholder() for s in slots})
        if page_phase is not None and sum(s.nbytes for s in slots) >= PAGE_ALIGN_MIN:
            # spaces until the data starts where the source's does within a page
            self._padded_len = len(header) + (page_phase - 8 - len(header)) % PAGE
            header = self._header({s.name: placeholder() for s in slots})
        self.header_len = len(header)
        self.data_start = 8 + len(header)
        self.nbytes = self.data_start + sum(s.nbytes for s in slots)
        # an OSError here (read-only folder, disk full) reaches ``staged_output``, which
        # names the output the user asked for, not this hidden temporary
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_at(fd, struct.pack("<Q", len(header)) + header, 0, path)
            os.ftruncate(fd, self.nbytes)  # the rest reads as zeros until written
        finally:
            os.close(fd)
        self._pos = self.data_start
        self._fd: int | None = None
        self._next = 0  # index of the next slot to begin
        self._current: list | None = None  # [slot, bytes left, Checksum or None]

    def _header(self, sums: dict[str, str]) -> bytes:
        meta = dict(self.metadata)
        if self.with_checksums:
            meta[KEY_CHECKSUMS] = json.dumps(sums, separators=(",", ":"))
        header: dict = {"__metadata__": meta}
        offset = 0
        for s in self.slots:
            code = dtypes.to_safetensors(s.dtype)
            header[s.name] = {
                "dtype": code,
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        if self._padded_len is not None:
            return raw + b" " * (self._padded_len - len(raw))
        return raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY)  # OSError: see __init__
        return self._fd

    def suspend(self) -> None:
        """Close the handle until the next write."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def begin(self, name: str) -> None:
        if self._current is not None or self._next >= len(self.slots):
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of order")
        slot = self.slots[self._next]
        if slot.name != name:
            raise CheckpointError(f"{self.path}: expected tensor {slot.name!r}, got {name!r}")
        self._next += 1
        self._current = [slot, slot.nbytes, Checksum() if self.with_checksums else None]

    def _claim(self, n: int) -> list:
        cur = self._current
        if cur is None or n > cur[1]:
            what = cur[0].name if cur else "no tensor"
            raise CheckpointError(f"{self.path}: more bytes than {what} holds")
        return cur

    def write(self, data) -> None:
        cur = self._claim(len(data))
        if cur[2] is not None:
            cur[2].update(data)
        write_at(self._file(), data, self._pos, self.path)
        self._pos += len(data)
        cur[1] -= len(data)

    def write_zeros(self, n: int) -> None:
        """Skip ``n`` bytes: the file was sized whole, so they read as zeros."""
        cur = self._claim(n)
        if cur[2] is not None:
            cur[2].update_zeros(n)
        self._pos += n
        cur[1] -= n

    def copy(self, src: FileRange, copier: Copier, tick=None) -> None:
        """Copy a file range here (the kernel's copy when no checksum is kept)."""
        cur = self._claim(src.nbytes)
        copier.copy(src, self._file(), self._pos, cur[2], tick)
        self._pos += src.nbytes
        cur[1] -= src.nbytes

    def put(self, piece, copier: Copier, tick=None) -> None:
        """One piece of the current tensor: a ``FileRange``, ``Zeros`` or bytes."""
        if isinstance(piece, FileRange):
            self.copy(piece, copier, tick)
            return
        if isinstance(piece, Zeros):
            self.write_zeros(piece.nbytes)
        else:
            self.write(piece)
        if tick:
            tick(size_of(piece))

    def end(self) -> str:
        """Close the current tensor; returns its checksum."""
        slot, left, digest = self._current
        if left:
            raise CheckpointError(f"{self.path}: tensor {slot.name!r} is {left} bytes short")
        self._current = None
        if digest is None:
            return ""
        self.checksums[slot.name] = digest.text()
        return self.checksums[slot.name]

    def finish(self) -> None:
        """Patch the real checksums into the header; the file is complete."""
        if self._next != len(self.slots) or self._current is not None:
            raise CheckpointError(f"{self.path}: not every tensor was written")
        header = self._header(self.checksums)
        if len(header) != self.header_len:  # cannot happen: digests are fixed width
            raise CheckpointError(f"{self.path}: header changed size while patching")
        write_at(self._file(), header, 8, self.path)
        self.suspend()

    def close(self) -> None:
        self.suspend()


# ---------------------------------------------------------------- outputs

_RANK_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")


def check_flat_name(out: Path, *, sharded: bool) -> None:
    """A flat checkpoint is ``NAME.safetensors``, or with ``--sharded`` a folder."""
    if sharded and out.name.endswith(".safetensors"):
        raise CheckpointError(
            f"output {out}: with --sharded the output is a folder of rank files; "
            "give a folder name without .safetensors"
        )
    if not sharded and not out.name.endswith(".safetensors"):
        raise CheckpointError(
            f"output {out}: a flat checkpoint is a .safetensors file (or, with --sharded, "
            "a folder of rank files)"
        )


def check_output(out: Path, *, inputs: Sequence[Path], force: bool, folder: bool) -> None:
    """Refuse an output that is an input (or holds one), or exists without ``--force``,
    or is a folder that is not a flat checkpoint set (never replaced, even forced)."""
    if not out.parent.is_dir():
        raise CheckpointError(
            f"output {out}: its folder {out.parent} does not exist; create it first "
            "(or choose another -o)"
        )
    target = out.resolve()
    for p in inputs:
        src = p.resolve()
        inside = folder and target in src.parents
        if src == target or inside or (out.exists() and _samefile(out, p)):
            raise CheckpointError(
                f"output {out} is the input {p}"
                + (" (or holds it)" if inside else "")
                + "; the input is never modified: choose another -o"
            )
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise CheckpointError(f"output {out} exists; pass --force to overwrite it")
    if folder and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is a file; a sharded set is a folder")
    if not folder and out.is_dir():
        raise CheckpointError(f"output {out} is a folder; give a file name such as out.safetensors")
    if folder:
        strangers = [p.name for p in out.iterdir() if not _ours(p.name)]
        if strangers or (any(out.iterdir()) and not (out / INDEX_NAME).is_file()):
            raise CheckpointError(
                f"output {out} is a folder that is not a yafsdp sharded checkpoint "
                f"(it holds {', '.join(sorted(strangers)[:3]) or 'no index'}); it is never "
                "replaced, even with --force: choose another -o"
            )


def existing_folder_output(
    out: Path, *, inputs: Sequence[Path], force: bool, kind: str
) -> list[str] | None:
    """For a command that writes a folder of another tool's format (``kind``: "a DCP
    checkpoint"): refuse an output that is (or holds) an input, or exists without
    ``--force``, or is a file. The names in the existing folder, for the caller to
    refuse what it would not write; None where ``out`` does not exist."""
    target = out.resolve()
    for p in inputs:
        src = p.resolve()
        if src == target or target in src.parents or (out.exists() and _samefile(out, p)):
            raise CheckpointError(
                f"output {out} is the input {p} (or holds it); the input is never modified: "
                "choose another -o"
            )
    if not out.exists() and not out.is_symlink():
        return None
    if not force:
        raise CheckpointError(f"output {out} exists; pass --force to overwrite it")
    if not out.is_dir():
        raise CheckpointError(f"output {out} exists and is a file; {kind} is a folder")
    return [p.name for p in out.iterdir()]


def _ours(name: str) -> bool:
    return name == INDEX_NAME or bool(_RANK_FILE.fullmatch(name))


def _samefile(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _token() -> str:
    """8 random hex digits for a temporary's name (``secrets`` costs ms to import)."""
    return os.urandom(4).hex()


class Staged:
    """A temporary output beside its target; ``keep = False`` discards it."""

    def __init__(self, out: Path, folder: bool):
        self.out = out
        self.folder = folder
        self.temp = out.parent / f".{out.name}.yafsdp-tmp-{os.getpid()}-{_token()}"
        self.keep = True

    def remove_temp(self) -> None:
        if self.folder:
            shutil.rmtree(self.temp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.temp.unlink()

    def commit(self) -> None:
        if not self.folder or not self.out.exists():
            os.replace(self.temp, self.out)  # atomic for a file; a new folder's name
            return
        old = self.out.parent / f".{self.out.name}.yafsdp-old-{_token()}"
        os.rename(self.out, old)
        try:
            os.rename(self.temp, self.out)
        except BaseException:
            os.rename(old, self.out)
            raise
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_output(out: Path, *, folder: bool) -> Iterator[Staged]:
    """Yield a ``Staged`` whose ``temp`` the caller fills; renamed over ``out`` on
    success, removed on any exception (Ctrl-C included) or when ``keep`` is False."""
    staged = Staged(out, folder)
    try:
        if folder:
            staged.temp.mkdir()
        yield staged
        if staged.keep:
            staged.commit()
    except OSError as exc:  # disk full, read-only folder: one line naming the output
        raise write_error(exc, out, CheckpointError) from None
    finally:
        if staged.temp.exists():
            staged.remove_temp()


def write_safetensors(
    path: Path, items, metadata, progress, copier: Copier, page_phase: int | None = None
) -> None:
    """A safetensors file of ``items`` (``reader.StateDictItem``), each copied from its
    byte ranges, in safetensors' own data order. ``page_phase``: the flat input's; a
    file that safetensors would write with the same page offset is unchanged by it."""
    by_name = {it.slot.name: it for it in items}
    slots = data_order([it.slot for it in items])
    total, done = sum(s.nbytes for s in slots), 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress("writing", done, total)

    writer = FileWriter(path, slots, metadata, checksums=False, page_phase=page_phase)
    try:
        for slot in slots:
            writer.begin(slot.name)
            for piece in coalesce(by_name[slot.name].ranges()):
                writer.put(piece, copier, tick)
            writer.end()
        writer.finish()
    finally:
        writer.close()
