"""Faults during a write: the disk filling up, SIGINT/SIGTERM, a verify rank dying.
Each ends with one line on stderr, the right exit code and no partial or hidden file."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SAMPLES
from typer.testing import CliRunner

from yafsdp_cli.checkpoint import convert_checkpoint, writer
from yafsdp_cli.cli import app
from yafsdp_cli.options import LayoutOptions

from .common import snapshot

runner = CliRunner()


def commands(src: Path, flat: Path, out: Path) -> dict[str, list[str]]:
    return {
        "convert": ["convert", str(src), "-o", str(out), "-n", "2"],
        "restore": ["restore", str(flat), "-o", str(out)],
        "reshard": ["reshard", str(flat), "-n", "4", "-o", str(out)],
    }


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path]:
    src = SAMPLES / "gpt.safetensors"
    flat = tmp_path / "flat.safetensors"
    convert_checkpoint(src, flat, LayoutOptions(world_size=2))
    return src, flat


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A folder on a 128 KiB tmpfs where we may mount one; else a writer that
    raises ENOSPC after the first few writes, as a full disk does."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(folder)],
            capture_output=True,
        ).returncode
        == 0
    )
    if not mounted:
        real, calls = writer.FileWriter.write, []

        def write(self, data):
            calls.append(1)
            if len(calls) > 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
            real(self, data)

        monkeypatch.setattr(writer.FileWriter, "write", write)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("command", ["convert", "restore", "reshard"])
def test_disk_full_is_one_line_naming_the_output(inputs, full_disk, command):
    out = full_disk / "o.safetensors"
    before = snapshot(full_disk.parent)
    result = runner.invoke(app, commands(*inputs, out)[command])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"no space left on device while writing {out}" in lines[0], lines[0]
    assert snapshot(full_disk.parent) == before  # nothing left, hidden temporaries included


# Every way the commands write output bytes (pwrite, and the kernel copies by range)
# is stretched, so the signal surely lands inside the write.
SLOW_MAIN = (
    "import os, time\n"
    "def slowed(real):\n"
    "    def slow(*args):\n"
    "        time.sleep(0.05)\n"
    "        return real(*args)\n"
    "    return slow\n"
    "for name in ('pwrite', 'copy_file_range', 'sendfile'):\n"
    "    setattr(os, name, slowed(getattr(os, name)))\n"
    "from yafsdp_cli.cli import main\n"
    "main()\n"
)


def wait_for_temp(folder: Path, proc: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        if any(".yafsdp-tmp-" in p.name for p in folder.iterdir()):
            return
        time.sleep(0.005)
    raise AssertionError(f"no temporary output appeared (exit {proc.poll()})")


@pytest.mark.parametrize("command", ["convert", "restore", "reshard"])
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_mid_write_leaves_nothing(inputs, tmp_path, command, sig, code):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = commands(*inputs, out_dir / "o.safetensors")[command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = snapshot(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_MAIN, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        # a shell may start background jobs with SIGINT ignored; a user's yafsdp has it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for_temp(out_dir, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert ("terminated" if sig == signal.SIGTERM else "interrupted") in lines[0]
    assert list(out_dir.iterdir()) == []
    assert {k: v for k, v in snapshot(tmp_path).items() if k != "out"} == {
        k: v for k, v in before.items() if k != "out"
    }


def rank_processes(pid: int) -> list[int]:
    """The verify ranks ``pid`` spawned (multiprocessing's spawn children)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    ranks = []
    for child in map(int, children):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            ranks.append(child)
    return sorted(ranks)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_rank_that_dies_ends_the_whole_verify_run(tmp_path):
    argv = ["verify", "--model", "sample_models.models:mlp", "--world-size", "2", "--steps", "5000"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from yafsdp_cli.cli import main; main()", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        while len(ranks := rank_processes(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(ranks) == 2, f"ranks did not start (exit {proc.poll()})"
        time.sleep(8)  # well into the steps: both ranks are inside their collectives
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    # verify's header (its memory estimate) comes first on stderr; then one error line
    lines = [line for line in err.strip().splitlines() if not line.startswith("verify: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "rank 1" in lines[0] and "SIGKILL" in lines[0], lines[0]
    assert not any(alive(r) for r in ranks), "a rank outlived the run"


@pytest.mark.parametrize("after_s", [0.2, 1.5])  # while the worker starts; while it runs
def test_ctrl_c_ends_a_plan_and_its_workers(after_s):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the
    plan's worker processes start and run fake steps: exit 130, one line, no worker
    left, no worker's traceback. (Sent once a worker is past its fork: in the few
    milliseconds of the fork itself the parent ignores SIGINT, see ``pool._pool``.)"""
    argv = ["plan", "--model", "sample_models.models:llama", "--gpu-memory", "1GiB"]
    argv += ["--reserve", "0", "--world-size", "1,2,4,8", "--micro-batch", "1,2,4,8,16", "-j", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from yafsdp_cli.cli import main; main()", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (workers := rank_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers, f"no worker started (exit {proc.poll()})"
        time.sleep(after_s)
        assert proc.poll() is None, "the plan ended before Ctrl-C"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0], err
    time.sleep(0.5)
    assert not any(alive(w) for w in workers), "a worker outlived the plan"


_INTERRUPT_IN_A_FINALIZER = """
import multiprocessing, signal, sys, time, weakref
import torch
from yafsdp_cli.cli.command_kit import interrupt_ends_at_once

def ring(_ref):  # Ctrl-C arriving while torch frees a storage: a finalizer runs
    signal.raise_signal(signal.SIGINT)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    keep = []
    with interrupt_ends_at_once() if sys.argv[1] == "guarded" else open(__file__):
        child.start()
        print(child.pid, flush=True)
        x = torch.randn(1000)
        keep.append(weakref.ref(x.untyped_storage(), ring))
        del x
        time.sleep(0.5)
    child.terminate()
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_ctrl_c_inside_a_torch_finalizer(tmp_path, guarded):
    """Python runs a KeyboardInterrupt raised in a finalizer as 'Exception ignored' and
    goes on (or, from a C++ destructor, ends in std::terminate). Around plan's and
    profile's computation Ctrl-C ends the command at once: one line, exit 130, no child
    left. The unguarded case shows what the guard is for."""
    script = tmp_path / "interrupt.py"
    script.write_text(_INTERRUPT_IN_A_FINALIZER)
    mode = "guarded" if guarded else "bare"
    done = subprocess.run(
        [sys.executable, str(script), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    child = int(done.stdout.split()[0])
    time.sleep(0.5)
    assert not alive(child), "a child outlived the command"
    if guarded:
        assert done.returncode == 130, done.stderr
        assert done.stderr.strip().splitlines() == ["error: interrupted; no output was written"]
    else:  # the interrupt is swallowed: the program runs on and exits 0
        assert done.returncode == 0 and "Exception ignored" in done.stderr, done.stderr
