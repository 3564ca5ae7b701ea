"""Files, defensively: JSON documents and byte ranges read with errors as project
errors, and output space reserved (``allocate``)."""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import SourceError, YafsdpError, printable

CHUNK_BYTES = 16 * 1024 * 1024
# JSON documents we read (config.json, index files, adapter and GPU profiles) are KBs
# to a few MB; a bigger one is refused before it is parsed, as a safetensors header is
MAX_JSON_BYTES = 100_000_000
# errno values of a failed write that are the output's fault, not the input's:
# ``checkpoint.writer.staged_output`` names the output
OUTPUT_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# Outputs this process has put in place, in order (``checkpoint.writer.Staged``
# records each as it renames it): an interrupted command says which it wrote in full
WRITTEN: list[Path] = []


def require_file(path: Path, *, error: type[YafsdpError] = SourceError) -> int:
    """``path``'s size; anything but a regular file (a FIFO, a device, a folder, a
    missing path) raises ``error`` before it is opened, so a FIFO cannot block us."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    kind = not_a_file(st.st_mode)
    if kind is not None:
        raise error(f"{path}: not a regular file ({kind}); give a weights file")
    return st.st_size


def not_a_file(mode: int) -> str | None:
    """What a path of ``stat`` mode ``mode`` is when it is no regular file ("a
    folder", "a FIFO, socket or device"), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return "a folder" if stat.S_ISDIR(mode) else "a FIFO, socket or device"


def read_capped(
    path: Path, cap: int, *, error: type[YafsdpError] = SourceError, what: str = "the file"
) -> bytes:
    """All of ``path``, refused (``error``) once more than ``cap`` bytes were read.

    The cap counts the bytes actually read, not what ``stat`` reports: a ``/proc``
    file or a file that grows while read says 0 or less than it gives."""
    require_file(path, error=error)
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None
    if len(data) > cap:
        raise error(f"{path}: {what} holds more than {cap} bytes, the most read here")
    return data


def read_json(
    path: Path, *, error: type[YafsdpError] = SourceError, cap: int = MAX_JSON_BYTES
) -> Any:
    """The JSON document in ``path``, at most ``cap`` bytes (checked before parsing);
    an unreadable, oversized or invalid file raises ``error``."""
    raw = read_capped(path, cap, error=error, what="its JSON")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise error(f"{path}: not valid JSON here (an integer of thousands of digits)") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None


def outside_link(folder: Path, path: Path) -> bool:
    """Whether reading ``path`` (a name in ``folder``) would go through a symbolic link
    that leads out of ``folder``: a checkpoint folder is read as the files it holds,
    never as whatever a link in it points at (``/proc/self/environ``, a home folder).

    A link to a file elsewhere in the folder is inside it. So is a Hugging Face hub
    cache's: ``models--org--name/snapshots/REV/`` holds links into the repo's own
    ``blobs/``, which is how the hub stores every file it downloads."""
    root = os.path.realpath(folder)
    real = os.path.realpath(path)
    return os.path.commonpath([root, real]) != root and not in_hub_blobs(folder, real)


def in_hub_blobs(folder: Path, target: str | Path) -> bool:
    """Whether ``target`` (resolved) is a file of the Hugging Face hub cache's
    ``blobs/`` that ``folder``, a ``snapshots/REV/`` of the same repo, links to."""
    snapshots = os.path.dirname(os.path.realpath(folder))
    if os.path.basename(snapshots) != "snapshots":
        return False
    return os.path.dirname(target) == os.path.join(os.path.dirname(snapshots), "blobs")


def require_inside(
    folder: Path, path: Path, *, error: type[YafsdpError] = SourceError, where: str = ""
) -> None:
    """Refuse ``path`` when reading it would leave ``folder`` through a link. There is
    no switch to follow one: a checkpoint folder is copied and shared as a unit, and
    a link out of it reads a file its user never named; copying the file in is the
    explicit way."""
    if outside_link(folder, path):
        raise error(
            f"{where or folder}: {printable(path.name)} is a symbolic link out of the folder "
            f"(to {printable(os.path.realpath(path))}); links out of a checkpoint folder are never "
            "followed: copy the file into the folder"
        )


def write_error(exc: OSError, out: Path, error: type[YafsdpError]) -> YafsdpError:
    """A failed write of output ``out`` as one clear project error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return error(
            f"no space left on device while writing {out}; nothing was written "
            "(free some space or choose another -o)"
        )
    return error(f"cannot write {out} ({exc.strerror or exc}); nothing was written")


def read_chunks(
    path: Path,
    offset: int,
    nbytes: int,
    chunk: int = CHUNK_BYTES,
    *,
    error: type[YafsdpError] = SourceError,
    what: str = "early",
) -> Iterator[memoryview]:
    """``nbytes`` bytes of ``path`` from ``offset`` with plain reads into one reused
    buffer; each chunk is valid until the next. A short file raises ``error``."""
    if nbytes <= 0:
        return
    buf = bytearray(min(chunk, nbytes))
    view = memoryview(buf)
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            while nbytes:
                n = f.readinto(view[: min(nbytes, len(buf))])
                if not n:
                    raise error(f"{path}: ended {what} (truncated file)")
                nbytes -= n
                yield view[:n]
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror})") from None


def read_exact(
    path: Path, offset: int, nbytes: int, *, error: type[YafsdpError] = SourceError
) -> bytes:
    """Exactly ``nbytes`` bytes of ``path`` from ``offset`` (a small record: a header,
    a pickle); a short file raises ``error``."""
    return b"".join(bytes(c) for c in read_chunks(path, offset, nbytes, error=error))


def allocate(fd: int, offset: int, nbytes: int) -> None:
    """``fallocate(fd, 0, offset, nbytes)``: blocks for the range, the size unchanged
    when the range ends inside the file. libc's ``fallocate`` through ``ctypes``, not
    ``os.posix_fallocate``, because glibc's ``posix_fallocate`` writes zeros into
    every block where the file system has no ``fallocate``: slow, and a reservation
    that costs a write is no saving. Raises ``OSError`` (``EOPNOTSUPP`` where there is
    no ``fallocate``)."""
    call = _libc_fallocate()
    if call is None:
        raise OSError(errno.EOPNOTSUPP, "no fallocate here")
    if call(fd, 0, offset, nbytes) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@functools.cache  # looked up on first use
def _libc_fallocate():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call
