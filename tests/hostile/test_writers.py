"""Outputs under stress: a signal at any point of a write, two writers of one output,
what a killed run left behind, and a full disk under a ``.pt`` output.

Every outcome is checked against the file system: an interrupted command that says
nothing was written left nothing (the old output, if any, untouched); one that says
its output was written in full left it complete."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SAMPLES
from typer.testing import CliRunner

import yafsdp_cli
from yafsdp_cli.checkpoint import convert_checkpoint, writer
from yafsdp_cli.cli import app
from yafsdp_cli.cli.command_kit import on_sigterm
from yafsdp_cli.options import LayoutOptions

from .common import snapshot

runner = CliRunner()
PACKAGE = str(Path(yafsdp_cli.__file__).parent)
SRC = SAMPLES / "mlp.safetensors"


def commands(src: Path, flat: Path, out: Path) -> dict[str, list[str]]:
    return {
        "convert": ["convert", str(src), "-o", str(out), "-n", "2"],
        # a forced folder output: the old set is moved aside, the new one renamed in
        "convert-sharded": ["convert", str(src), "-o", str(out), "-n", "8", "--sharded"],
        "reshard": ["reshard", str(flat), "-n", "4", "-o", str(out)],
        "restore": ["restore", str(flat), "-o", str(out)],
        "restore-pt": ["restore", str(flat), "-o", str(out), "--format", "pt"],
    }


def out_name(command: str) -> str:
    return {"convert-sharded": "o", "restore-pt": "o.pt"}.get(command, "o.safetensors")


@pytest.fixture
def flat(tmp_path) -> Path:
    path = tmp_path / "in" / "flat.safetensors"
    path.parent.mkdir()
    convert_checkpoint(SRC, path, LayoutOptions(world_size=2))
    return path


def contents(path: Path) -> dict | None:
    """What ``path`` holds (a file's digest, or a folder's snapshot); None if absent."""
    if not os.path.lexists(path):
        return None
    if path.is_dir():
        return snapshot(path)
    return snapshot(path.parent)[path.name]  # type: ignore[return-value]


# ---------------------------------------------------------------- signals


class InterruptAt:
    """A tracer that sends ``sig`` to this process at the ``n``-th line the package
    runs (``n = 0``: never), and notes the line count at which an output is renamed
    into place: a signal lands where a Python handler would run, between lines."""

    def __init__(self, n: int, sig: int):
        self.n, self.sig = n, sig
        self.lines = 0
        self.commit: int | None = None

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if frame.f_code.co_name == "commit" and self.commit is None:
            self.commit = self.lines
        return self.line

    def line(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.n:
                signal.raise_signal(self.sig)
        return self.line


def run_traced(argv: list[str], tracer: InterruptAt):
    """``yafsdp ARGV`` in this process, as the console script runs it: SIGTERM raises
    ``Terminated``, SIGINT ``KeyboardInterrupt``."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.settrace(tracer)
    try:
        return runner.invoke(app, argv)
    finally:
        sys.settrace(None)
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.parametrize(
    ("command", "sig"),
    [
        ("convert", signal.SIGINT),
        ("convert-sharded", signal.SIGINT),
        ("reshard", signal.SIGINT),
        ("convert-sharded", signal.SIGTERM),
    ],
)
def test_a_signal_anywhere_is_reported_as_what_happened(flat, tmp_path, command, sig):
    """The signal lands at one line after another, densely around the rename into
    place: whatever the command then says matches what is on disk."""
    code, word = (130, "interrupted") if sig == signal.SIGINT else (143, "terminated (SIGTERM)")
    folder = tmp_path / "ref"
    folder.mkdir()
    out = folder / out_name(command)
    argv = commands(SRC, flat, out)[command]
    if command == "convert-sharded":  # an old set to replace: two renames, not one
        assert runner.invoke(app, [*argv, "-n", "4"]).exit_code == 0
    old = contents(out)
    calibration = InterruptAt(0, sig)
    assert run_traced([*argv, "--force"], calibration).exit_code == 0
    new, end, commit = contents(out), calibration.lines, calibration.commit
    assert commit is not None and new is not None and new != old
    points = sorted(
        {*range(commit - 4, commit + 30, 2), *range(commit + 30, end, max(1, (end - commit) // 6))}
        | {commit // 3, 2 * commit // 3}
    )
    seen = set()
    for n in points:
        folder = tmp_path / f"at{n}"
        folder.mkdir()
        out = folder / out_name(command)
        argv = commands(SRC, flat, out)[command]
        if old is not None:
            assert runner.invoke(app, [*argv, "-n", "4"]).exit_code == 0
        result = run_traced([*argv, "--force"], InterruptAt(n, sig))
        lines = result.stderr.strip().splitlines()
        leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
        assert leftovers == [], (n, leftovers, result.stderr)
        if result.exit_code == 0:
            assert contents(out) == new, n
            seen.add("ok")
            continue
        assert result.exit_code == code and len(lines) == 1, (n, result.exit_code, result.stderr)
        if lines[0] == f"error: {word}; no output was written":
            assert contents(out) == old, (n, "said nothing was written, but the output changed")
            seen.add("before")
        else:
            assert lines[0] == f"error: {word} after {out} was written in full", (n, lines)
            assert contents(out) == new, (n, "said written in full, but it is not")
            seen.add("after")
    assert seen >= {"before", "after"}, seen


def yafsdp(args: list[str], *, wrapper: str | None = None, env=None, **kw):
    code = wrapper or "from yafsdp_cli.cli import main; main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
        **kw,
    )


# The wrapped command stops right after renaming its output into place until the
# test, having sent its signal, lets it go on.
PAUSED_AFTER_RENAME = (
    "import os, time\n"
    "from yafsdp_cli.checkpoint import writer\n"
    "real = writer.Staged.commit\n"
    "def commit(self):\n"
    "    real(self)\n"
    "    open(os.environ['PAUSED_AT'], 'w').close()\n"
    "    while not os.path.exists(os.environ['GO_ON']):\n"
    "        time.sleep(0.01)\n"
    "writer.Staged.commit = commit\n"
    "from yafsdp_cli.cli import main\n"
    "main()\n"
)


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = proc.communicate()
            raise AssertionError(f"the writer did not reach its rename: {err}")
        time.sleep(0.01)


@pytest.mark.parametrize("command", ["convert-sharded", "reshard"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_just_after_the_rename_says_the_output_is_whole(
    flat, tmp_path, command, sig, code
):
    """A real process, signalled the moment its output is in place (20-30 ms before
    the end of a sharded convert): exit 130/143, and a line saying the output was written in
    full, which it is (the same as an undisturbed run's)."""
    folder, reference = tmp_path / "out", tmp_path / "ref"
    folder.mkdir()
    reference.mkdir()
    out = folder / out_name(command)
    made = runner.invoke(app, commands(SRC, flat, reference / out.name)[command])
    assert made.exit_code == 0, made.output
    paused, go_on = tmp_path / "paused", tmp_path / "go-on"
    proc = yafsdp(
        commands(SRC, flat, out)[command],
        wrapper=PAUSED_AFTER_RENAME,
        env={"PAUSED_AT": str(paused), "GO_ON": str(go_on)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(paused, proc)
        proc.send_signal(sig)
        go_on.touch()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    word = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"error: {word} after {out} was written in full"]
    assert contents(out) == contents(reference / out.name)
    assert sorted(p.name for p in folder.iterdir()) == [out.name]


def test_a_signal_held_while_renaming_is_acted_on_after():
    """``signals_held``: a SIGINT inside the block raises once the block is done."""
    done = []
    with pytest.raises(KeyboardInterrupt), writer.signals_held():
        signal.raise_signal(signal.SIGINT)
        done.append("rest of the block")
    assert done == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---------------------------------------------------------------- two writers

# The wrapped command stops just before renaming its output into place (its lock
# held, its temporary complete) until the test lets it go: a deterministic "first
# writer still at work".
PAUSED_MAIN = (
    "import os, sys, time\n"
    "from yafsdp_cli.checkpoint import writer\n"
    "real = writer.Staged.commit\n"
    "def commit(self):\n"
    "    open(os.environ['PAUSED_AT'], 'w').close()\n"
    "    while not os.path.exists(os.environ['GO_ON']):\n"
    "        time.sleep(0.01)\n"
    "    real(self)\n"
    "writer.Staged.commit = commit\n"
    "from yafsdp_cli.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("command", ["convert", "convert-sharded", "reshard", "restore"])
def test_a_second_writer_of_one_output_is_refused_naming_the_first(flat, tmp_path, command):
    folder = tmp_path / "out"
    folder.mkdir()
    out = folder / out_name(command)
    argv = commands(SRC, flat, out)[command] + ["--json"]
    reference = tmp_path / "ref"
    reference.mkdir()
    made = runner.invoke(app, commands(SRC, flat, reference / out.name)[command])
    assert made.exit_code == 0, made.output
    paused, go_on = tmp_path / "paused", tmp_path / "go-on"
    first = yafsdp(argv, wrapper=PAUSED_MAIN, env={"PAUSED_AT": str(paused), "GO_ON": str(go_on)})
    try:
        wait_for(paused, first)
        second = yafsdp(argv)
        _, err = second.communicate(timeout=60)
        go_on.touch()
        _, first_err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: output {out} is being written by process {first.pid} "), err
    assert first.returncode == 0, first_err
    # the first writer's output is whole (the same as an undisturbed run's) and alone
    assert contents(out) == contents(reference / out.name)
    assert sorted(p.name for p in folder.iterdir()) == [out.name]


def test_an_output_made_by_another_writer_meanwhile_is_not_replaced(tmp_path, monkeypatch):
    """A second writer that checked the output before the first put it there refuses
    it once it holds the lock, as if it had been there from the start."""
    out = tmp_path / "o.safetensors"
    real = writer.Staged.open

    def open_after_another_writer(self):
        out.write_bytes(b"the other writer's output")
        real(self)

    monkeypatch.setattr(writer.Staged, "open", open_after_another_writer)
    result = runner.invoke(app, ["convert", str(SRC), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: output {out} exists; pass --force to overwrite it"
    ]
    assert out.read_bytes() == b"the other writer's output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.safetensors"]


# ---------------------------------------------------------------- leftovers


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_dead_run_are_named_and_removed(tmp_path):
    out = tmp_path / "o.safetensors"
    pid = dead_pid()
    temp_file = tmp_path / f".o.safetensors.yafsdp-tmp-{pid}-0123abcd"
    temp_file.write_bytes(b"half a checkpoint")
    temp_folder = tmp_path / f".o.safetensors.yafsdp-tmp-{pid}-4567cdef"
    temp_folder.mkdir()
    (temp_folder / "rank-00000-of-00002.safetensors").write_bytes(b"half")
    stale_lock = tmp_path / ".o.safetensors.yafsdp-lock"
    stale_lock.write_text(f"{pid}\n")  # a killed run's lock file: the kernel freed its lock
    other = tmp_path / f".p.safetensors.yafsdp-tmp-{pid}-89abcdef"  # another output's
    other.write_bytes(b"not ours to judge")
    result = runner.invoke(app, ["convert", str(SRC), "-o", str(out)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: removed {temp_file.name}, {temp_folder.name}, left beside {out} by a run "
        "that ended without cleaning up"
    ], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "o.safetensors"]


def test_a_leftover_of_a_running_process_is_kept(tmp_path):
    out = tmp_path / "o.safetensors"
    mine = tmp_path / f".o.safetensors.yafsdp-tmp-{os.getpid()}-0123abcd"
    mine.write_bytes(b"being written")
    result = runner.invoke(app, ["convert", str(SRC), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"warning: kept {mine.name} beside {out}: its process {os.getpid()} still runs" in (
        result.stderr
    )
    assert mine.read_bytes() == b"being written" and out.is_file()


def test_the_temporary_of_the_lock_holder_is_left_alone(tmp_path):
    out = tmp_path / "o.safetensors"
    mine = tmp_path / f".o.safetensors.yafsdp-tmp-{os.getpid()}-0123abcd"
    mine.write_bytes(b"being written")
    lock = tmp_path / ".o.safetensors.yafsdp-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        before = snapshot(tmp_path)
        result = runner.invoke(app, ["convert", str(SRC), "-o", str(out)])
        after = snapshot(tmp_path)
    finally:
        os.close(fd)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"is being written by process {os.getpid()} " in lines[0], lines[0]
    assert after == before


def test_an_old_output_moved_aside_by_a_killed_run_is_put_back(tmp_path):
    """Killed between its two renames (the old set moved aside, the new one not yet
    in place): the next writer of that name puts the old set back and says so."""
    out = tmp_path / "o"
    made = runner.invoke(app, ["convert", str(SRC), "-o", str(out), "-n", "2", "--sharded"])
    assert made.exit_code == 0, made.output
    was = snapshot(out)
    aside = tmp_path / f".o.yafsdp-old-{dead_pid()}-0123abcd"
    out.rename(aside)
    result = runner.invoke(app, ["convert", str(SRC), "-o", str(out), "-n", "4", "--sharded"])
    assert result.stderr.strip().splitlines() == [
        f"warning: put back {out} from {aside.name}, where a killed run had moved it aside",
        f"error: output {out} exists; pass --force to overwrite it",
    ]
    assert result.exit_code == 2
    assert snapshot(out) == was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def tiny_disk(tmp_path):
    """A 128 KiB tmpfs, where we may mount one."""
    folder = tmp_path / "full"
    folder.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(folder)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_under_a_pt_output_is_one_line_naming_it(tmp_path, tiny_disk):
    flat = tmp_path / "gpt.safetensors"  # 480 KiB: more than the disk holds
    convert_checkpoint(SAMPLES / "gpt.safetensors", flat, LayoutOptions(world_size=2))
    out = tiny_disk / "o.pt"
    result = runner.invoke(app, ["restore", str(flat), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: no space left on device while writing {out}; nothing was written (free "
        "some space or choose another -o)"
    ]
    assert list(tiny_disk.iterdir()) == []


@pytest.mark.parametrize("by_name", [False, True])
def test_torch_save_on_a_full_disk_raises_enospc(tiny_disk, by_name):
    """The file object's write error, or (torch writing by name) the full file
    system, rather than torch's "[enforce fail at inline_container.cc]"."""
    import torch

    with pytest.raises(OSError) as caught:
        writer.torch_save({"w": torch.zeros(100_000)}, tiny_disk / "optimizer.pt", by_name=by_name)
    assert caught.value.errno == errno.ENOSPC
