"""Streaming safetensors writer and all-or-nothing outputs.

``FileWriter`` writes one safetensors file front to back without holding any
tensor: the header goes first (every offset is known from the slots), with
fixed-width placeholder checksums, and the file is sized whole at once, so that
zeros (padding) are skipped rather than written and read back as zeros (holes
where the file system has them); each tensor's pieces (``file_ranges.py``: file ranges,
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
end; on any error, Ctrl-C included, the temporary is removed. Around it:

- one writer per output: an exclusive ``flock`` on ``.NAME.yafsdp-lock`` beside the
  target, held from before the temporary is made until after it is gone, so a
  second writer of the same output fails at once naming the first (whose PID the
  file holds). The kernel drops the lock of a process that dies, killed or not, so
  a lock file left behind never blocks anyone;
- what a killed run left (``.NAME.yafsdp-tmp-PID-RAND``, ``.NAME.yafsdp-old-PID-RAND``)
  is removed, and named on stderr, by the next writer of NAME, under the lock and
  only when that PID is gone;
- SIGINT and SIGTERM are held while the temporary is renamed into place and the
  output recorded as written (``fileio.WRITTEN``), and while the temporary and the
  lock are removed: a signal is acted on before the rename (nothing written) or
  after the record (the output complete, and reported so), never in between.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..engine import dtypes
from ..errors import CheckpointError, printable
from ..fileio import WRITTEN, write_error
from .file_ranges import Copier, FileRange, Zeros, coalesce, size_of, write_at
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


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Held:
    """A SIGINT/SIGTERM handler that keeps the first signal while ``holding`` and
    passes every signal to the handler it stands in for once not."""

    def __init__(self, handlers: dict):
        self.handlers = handlers
        self.holding = True
        self.pending: int | None = None

    def __call__(self, signum, frame) -> None:
        if self.holding:
            if self.pending is None:
                self.pending = signum
            return
        self.handlers[signum](signum, frame)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Run the block whole: a SIGINT or SIGTERM that arrives meanwhile is acted on
    (its Python handler called: KeyboardInterrupt) when the block ends.

    Python runs signal handlers in the main thread between bytecodes, whichever
    thread the kernel chose, so swapping the handlers is what holds them (a signal
    mask would not: torch's threads would take the signal). ``holding`` is switched
    off in one step before the handlers are put back, so a signal that lands while
    they are put back is not lost. Handlers that are not Python functions (the
    default action, ignored) are left as they are: a signal they handle runs no
    Python code to interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run in the main thread only: nothing to hold here
        return
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    handlers = {s: h for s, h in handlers.items() if callable(h)}
    held = _Held(handlers)
    try:
        for s in handlers:
            signal.signal(s, held)
        yield
    finally:
        held.holding = False
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if held.pending is not None:
            handlers[held.pending](held.pending, None)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.yafsdp-lock"


class OutputLock:
    """An exclusive ``flock`` on ``.NAME.yafsdp-lock`` beside output ``out``: one
    writer per output. The file holds the holder's PID, for a second writer's
    message; the holder removes it (while still holding the lock) when done."""

    def __init__(self, out: Path):
        self.out = out
        self.path = lock_path(out)
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            # never through a link: the file is truncated and written
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                who = f"process {holder}" if holder else "another process"
                raise CheckpointError(
                    f"output {self.out} is being written by {who} (yafsdp; lock "
                    f"{self.path.name}); wait for it to end, or choose another -o"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            # the holder before us removes the file before it unlocks: a lock taken
            # on a file no longer at ``path`` locks nobody out, so take it again
            try:
                here = os.stat(self.path)
            except FileNotFoundError:
                here = None
            mine = os.fstat(fd)
            if here is not None and (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                break
            os.close(fd)
        self.fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def _holder(fd: int) -> int | None:
    """The PID a lock file names, if it names one yet."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True  # another user's: it runs
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


_LEFTOVER = re.compile(r"(tmp|old)-(?:(\d+)-)?[0-9a-f]{8}")


def clear_leftovers(out: Path) -> None:
    """Remove what an ended run left beside ``out`` (its hidden temporary, or the
    old output it had moved aside), naming it on stderr; called with ``out``'s lock
    held, so no writer of ``out`` is at work. A leftover whose process still runs is
    named and kept (a writer that takes no lock). An old output moved aside by a run
    killed between its two renames is put back when nothing took its place."""
    prefix = f".{out.name}.yafsdp-"
    removed: list[str] = []
    try:
        names = sorted(n for n in os.listdir(out.parent) if n.startswith(prefix))
    except OSError:
        return  # the write itself reports an unusable folder
    for name in names:
        found = _LEFTOVER.fullmatch(name[len(prefix) :])
        if found is None:
            continue  # the lock file, or not ours
        path = out.parent / name
        if found[2] is not None and _alive(int(found[2])):
            _warn(f"kept {name} beside {out}: its process {found[2]} still runs")
            continue
        if found[1] == "old" and not os.path.lexists(out):
            with contextlib.suppress(OSError):
                os.rename(path, out)
                _warn(f"put back {out} from {name}, where a killed run had moved it aside")
                continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(name)
    if removed:
        shown = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if removed[3:] else "")
        _warn(f"removed {shown}, left beside {out} by a run that ended without cleaning up")


def _warn(text: str) -> None:
    sys.stderr.write(f"warning: {printable(text)}\n")
    sys.stderr.flush()


class Staged:
    """A temporary output beside its target; ``keep = False`` discards it.

    ``open()`` takes the output's lock, clears what ended runs left, refuses an
    output that appeared meanwhile (unless ``force``) and, for a folder, makes the
    temporary; ``commit()`` renames it into place; ``close()`` removes what is left
    of the temporary and lets go of the lock."""

    def __init__(self, out: Path, folder: bool, *, force: bool = False):
        self.out = out
        self.folder = folder
        self.force = force
        self.temp = out.parent / f".{out.name}.yafsdp-tmp-{os.getpid()}-{_token()}"
        self.keep = True
        self.lock = OutputLock(out)

    def open(self) -> None:
        with signals_held():  # a lock taken is a lock let go: see ``close``
            self.lock.acquire()
        clear_leftovers(self.out)
        if not self.force and os.path.lexists(self.out):
            # another writer put it there since ``check_output`` looked
            raise CheckpointError(f"output {self.out} exists; pass --force to overwrite it")
        if self.folder:
            self.temp.mkdir()

    def remove_temp(self) -> None:
        if self.folder:
            shutil.rmtree(self.temp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.temp.unlink()

    def close(self) -> None:
        with signals_held():  # removed whole: a signal now would leave a part
            if os.path.lexists(self.temp):
                self.remove_temp()
            self.lock.release()

    def commit(self) -> None:
        """Rename the temporary into place and record the output as written, with
        signals held: either both happen or neither does."""
        with signals_held():
            self._rename()
            WRITTEN.append(self.out)

    def _rename(self) -> None:
        if not self.folder or not self.out.exists():
            os.replace(self.temp, self.out)  # atomic for a file; a new folder's name
            return
        old = self.out.parent / f".{self.out.name}.yafsdp-old-{os.getpid()}-{_token()}"
        os.rename(self.out, old)
        try:
            os.rename(self.temp, self.out)
        except BaseException:
            os.rename(old, self.out)
            raise
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_output(out: Path, *, folder: bool, force: bool = False) -> Iterator[Staged]:
    """Yield a ``Staged`` whose ``temp`` the caller fills; renamed over ``out`` on
    success, removed on any exception (Ctrl-C included) or when ``keep`` is False.
    ``force``: ``out`` may exist (``check_output`` has vetted it); without it an
    output that another writer made since is refused rather than replaced."""
    staged = Staged(out, folder, force=force)
    try:
        staged.open()
        yield staged
        # put in place and cleaned up as one: a signal from here on is acted on
        # once the lock is let go (before, it leaves the work to ``finally``)
        with signals_held():
            if staged.keep:
                staged.commit()
            staged.close()
    except OSError as exc:  # disk full, read-only folder: one line naming the output
        raise write_error(exc, out, CheckpointError) from None
    finally:
        staged.close()  # after an error or a signal (else nothing is left to do)


class _Recorded:
    """A file object for ``torch.save`` that keeps the first ``OSError`` of a write:
    torch turns it into its own RuntimeError ("unexpected pos")."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as exc:
            self.error = self.error or exc
            raise


def torch_save(obj, path: Path, *, by_name: bool = False) -> None:
    """``torch.save(obj)`` as the new file ``path``. A failed write (a full disk)
    raises an ``OSError``, which ``staged_output`` names, rather than torch's
    "[enforce fail at inline_container.cc] unexpected pos".

    ``by_name``: torch opens the file itself, so the archive inside is named after
    it (``optimizer/data.pkl``, as the Hugging Face Trainer saves it; from a file
    object it is ``archive/``). torch's own writes keep no ``errno``, so a failure
    is taken for a full disk when the file system has (next to) no space left."""
    import torch

    # torch's error is dropped before ours is raised (not kept as its context):
    # its traceback holds torch's writer, and with it the file, open
    failed = False
    if by_name:
        try:
            torch.save(obj, str(path))
        except RuntimeError:
            failed = True
        if failed and _full(path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        if failed:
            raise OSError(errno.EIO, "torch.save could not write it", str(path))
        return
    with open(path, "xb") as f:
        sink = _Recorded(f)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            failed = True
    if failed:
        raise OSError(sink.error.errno, sink.error.strerror, str(path))


FULL_BELOW = 1 << 20  # free bytes under which a failed write is taken for a full disk


def _full(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserve
    return free * st.f_frsize < FULL_BELOW


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
