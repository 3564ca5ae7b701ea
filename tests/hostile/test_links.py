"""Links out of a Trainer folder and its parts that cannot be read: refused with exit 2
and one line naming the entry, nothing written, and no byte of the file behind the
link in any output; the carried files' cap counts the bytes read. The same rule for
model folders, adapters, index files and sharded sets runs in the corpus
(``link_cases.LINKS``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app

from .link_cases import BAD_OPTIMIZERS, LINK_OUT, SECRET, outside, secret_file, trainer_folder

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return trainer_folder(tmp_path_factory.mktemp("trainer") / "checkpoint-1")


@pytest.fixture
def folder(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "checkpoint-1", symlinks=True))


def error_line(result) -> str:
    """The one error line of a refused run (exit 2)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0] and "Traceback" not in result.output
    return lines[0]


def written(tmp_path: Path) -> list[str]:
    """What the run left in ``tmp_path`` besides the checkpoint and the outside folder
    (hidden temporaries included)."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in ("checkpoint-1", "outside"))


def no_secret_in(*paths: Path) -> None:
    for root in paths:
        for p in [root] if root.is_file() else root.rglob("*"):
            if p.is_file():
                assert SECRET.encode() not in p.read_bytes(), p


def test_the_built_folder_converts_with_its_optimizer(folder, tmp_path):
    """The control for the refusals below: the same folder, unbroken, converts whole."""
    from yafsdp_cli.checkpoint import open_flat

    flat = tmp_path / "flat.safetensors"
    result = run("convert", folder, "-o", flat)
    assert result.exit_code == 0, result.output
    optim = open_flat(flat).optim
    assert optim.form == "trainer" and {"scheduler.pt", "trainer_state.json"} <= set(optim.files)


def _carried(folder: Path) -> None:
    (folder / "notes.txt").symlink_to(secret_file(folder.parent))


def _replaced(name: str):
    """``name`` moved out of the folder, the secret appended, and linked back in."""

    def apply(folder: Path) -> None:
        moved = outside(folder.parent) / name
        shutil.move(folder / name, moved)
        with open(moved, "ab") as f:
            f.write(SECRET.encode())
        (folder / name).symlink_to(moved)

    return apply


def _weights_out(folder: Path) -> None:
    """model.safetensors moved out with the secret in its metadata, linked back in."""
    from safetensors.torch import load_file, save_file

    moved = outside(folder.parent) / "model.safetensors"
    save_file(load_file(folder / "model.safetensors"), moved, {"format": "pt", "note": SECRET})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(moved)


@pytest.mark.parametrize(
    ("edit", "name", "weights_only_reads_it"),
    [
        (_carried, "notes.txt", False),
        (_replaced("scheduler.pt"), "scheduler.pt", False),
        (_replaced("optimizer.pt"), "optimizer.pt", False),
        (_weights_out, "model.safetensors", True),
    ],
    ids=["carried-file", "scheduler.pt", "optimizer.pt", "model.safetensors"],
)
def test_a_link_out_of_a_trainer_folder_is_refused(
    folder, tmp_path, edit, name, weights_only_reads_it
):
    edit(folder)
    flat = tmp_path / "flat"
    result = run("convert", folder, "-o", flat, "-n", "2", "--sharded")
    line = error_line(result)
    assert re.search(f"{re.escape(str(folder))}: {re.escape(name)} {LINK_OUT}", line), line
    assert SECRET not in result.output and written(tmp_path) == []
    # --weights-only reads neither optimizer.pt nor the carried files; the weights are
    # read by every command
    result = run("convert", folder, "-o", flat, "-n", "2", "--sharded", "--weights-only")
    if weights_only_reads_it:
        assert name in error_line(result) and written(tmp_path) == []
    else:
        assert result.exit_code == 0, result.output
        assert SECRET not in result.output
        no_secret_in(flat)


def test_a_link_to_proc_environ_never_reaches_the_checkpoint(folder, tmp_path):
    """``/proc/self/environ`` stats as 0 bytes: through the link it would have been
    carried whole, tokens and all, into every rank file; convert then restore --format
    trainer stops at convert and leaves nothing. Run in this process, so the file
    behind the link is this process's environment: none of its entries may show."""
    environ = Path("/proc/self/environ")
    if not environ.exists():
        pytest.skip("no /proc/self/environ here")
    entries = [e for e in environ.read_bytes().split(b"\0") if len(e) > 8]
    assert entries, "an empty environment proves nothing"
    (folder / "env.txt").symlink_to(environ)
    flat, back = tmp_path / "flat", tmp_path / "back"
    result = run("convert", folder, "-o", flat, "-n", "2", "--sharded")
    line = error_line(result)
    assert re.search(f"{re.escape(str(folder))}: env.txt {LINK_OUT}", line), line
    shown = result.output + result.stderr
    assert not any(e.decode(errors="replace") in shown for e in entries)
    assert written(tmp_path) == []
    line = error_line(run("restore", flat, "-o", back, "--format", "trainer"))
    assert "no such file or folder" in line and written(tmp_path) == []


def test_the_chain_convert_restore_stops_at_convert(folder, tmp_path):
    """A carried file linked out never gets into a checkpoint, so restore --format
    trainer has nothing to write it back from."""
    _carried(folder)
    for flat, sharded in ((tmp_path / "flat.safetensors", []), (tmp_path / "flat", ["--sharded"])):
        back = tmp_path / "back"
        assert "notes.txt" in error_line(run("convert", folder, "-o", flat, *sharded))
        assert "no such file" in error_line(run("restore", flat, "-o", back, "--format", "trainer"))
        assert written(tmp_path) == []


def test_a_link_inside_the_folder_is_carried(folder, tmp_path):
    from yafsdp_cli.checkpoint import open_flat

    (folder / "latest.json").symlink_to("trainer_state.json")
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back"
    assert run("convert", folder, "-o", flat).exit_code == 0
    assert "latest.json" in open_flat(flat).optim.files
    result = run("restore", flat, "-o", back, "--format", "trainer")
    assert result.exit_code == 0, result.output
    assert (back / "latest.json").read_bytes() == (folder / "trainer_state.json").read_bytes()


def test_a_hub_cache_snapshot_links_into_its_blobs(built, tmp_path):
    """The hub stores each file once in ``blobs/`` and links to it from
    ``snapshots/REV/``: those links stay inside the repo's cache and are read."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        shutil.copyfile(built / name, repo / "blobs" / f"blob{i}")
        (snap / name).symlink_to(f"../../blobs/blob{i}")
    result = run("inspect", snap)
    assert result.exit_code == 0, result.output
    (snap / "config.json").unlink()  # the same link to a file beside blobs/: refused
    shutil.copyfile(built / "config.json", repo / "config.json")
    (snap / "config.json").symlink_to("../../config.json")
    assert re.search("config.json " + LINK_OUT, error_line(run("inspect", snap)))


# ---------------------------------------------------------------- optimizer.pt


@pytest.mark.parametrize("kind", list(BAD_OPTIMIZERS))
def test_an_unreadable_optimizer_is_an_error_not_a_missing_part(folder, tmp_path, kind):
    from yafsdp_cli.checkpoint import open_flat

    make, words = BAD_OPTIMIZERS[kind]
    if kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file of mode 000; the dangling and looping links fail open")
    (folder / "optimizer.pt").unlink()
    try:
        make(folder / "optimizer.pt")
    except PermissionError:
        pytest.skip(f"no right to make a {kind} here")
    flat = tmp_path / "flat.safetensors"
    line = error_line(run("convert", folder, "-o", flat))
    assert f"{folder / 'optimizer.pt'}: {words}" in line and "--weights-only" in line, line
    assert written(tmp_path) == []
    result = run("convert", folder, "-o", flat, "--weights-only")
    assert result.exit_code == 0, result.output
    assert open_flat(flat).optim is None


# ---------------------------------------------------------------- sizes read


@contextlib.contextmanager
def bound_over(target: str, path: Path):
    """``target`` (a ``/proc`` file) bind-mounted over the file ``path``: a regular
    file in the folder, no link, whose size says 0 and which reads more."""
    path.touch()
    done = subprocess.run(["mount", "--bind", target, str(path)], capture_output=True)
    if done.returncode:
        pytest.skip("cannot bind-mount a /proc file here (needs root)")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_the_carried_files_cap_counts_bytes_read(folder, tmp_path, monkeypatch):
    from yafsdp_cli.sources import trainer_folder as module

    weights = ("optimizer.pt", "model.safetensors")
    sizes = sum(p.stat().st_size for p in folder.iterdir() if p.name not in weights)
    monkeypatch.setattr(module, "MAX_FILES_BYTES", sizes + 16)  # room for 16 bytes more
    env = folder / "environ"
    with bound_over(f"/proc/{os.getpid()}/environ", env):
        assert env.stat().st_size == 0 and len(env.read_bytes()) > 16
        flat = tmp_path / "flat.safetensors"
        line = error_line(run("convert", folder, "-o", flat))
    assert re.search(r"files besides the weights and optimizer.pt give \d+ bytes when read", line)
    assert f", though their sizes say {sizes} (environ: " in line and written(tmp_path) == []
