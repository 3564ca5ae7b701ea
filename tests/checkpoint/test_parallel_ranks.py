"""Rank files written side by side (``checkpoint/parallel_ranks.py``): the same bytes
as one writer writing them in turn, and a failure in one writer stops the others
and leaves nothing behind."""

from __future__ import annotations

import pytest
from checkpoint_helpers import sample

from yafsdp_cli import CheckpointError
from yafsdp_cli.checkpoint import (
    convert_checkpoint,
    flat_writer,
    parallel_ranks,
    reshard_checkpoint,
)
from yafsdp_cli.checkpoint import file_ranges as copy_mod
from yafsdp_cli.checkpoint.file_ranges import FileRange, Zeros
from yafsdp_cli.checkpoint.flat_writer import shard_pieces
from yafsdp_cli.options import LayoutOptions


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def writers(monkeypatch, n: int) -> None:
    """``n`` writer threads whatever the machine's cores (1: one file at a time)."""
    monkeypatch.setattr(flat_writer, "writers_for", lambda shards: min(n, shards))


@pytest.mark.parametrize("source", ["gpt.safetensors", "moe.safetensors", "cnn.safetensors"])
def test_side_by_side_writes_the_bytes_one_writer_writes(tmp_path, monkeypatch, source):
    writers(monkeypatch, 2)
    together = tmp_path / "two"
    convert_checkpoint(sample(source), together, LayoutOptions(world_size=5), sharded=True)
    resharded = tmp_path / "two3"
    reshard_checkpoint(together, resharded, world_size=3, sharded=True)
    writers(monkeypatch, 1)
    alone = tmp_path / "one"
    convert_checkpoint(sample(source), alone, LayoutOptions(world_size=5), sharded=True)
    resharded_alone = tmp_path / "one3"
    reshard_checkpoint(alone, resharded_alone, world_size=3, sharded=True)
    assert files_of(together) == files_of(alone)
    assert files_of(resharded) == files_of(resharded_alone)


def spy_writers(monkeypatch) -> list[int]:
    """The writer-thread counts of every side-by-side write, as they happen."""
    threads: list[int] = []
    real = parallel_ranks.write_side_by_side

    def spy(writers, contents, copier, tick, n):
        threads.append(n)
        return real(writers, contents, copier, tick, n)

    monkeypatch.setattr(flat_writer, "write_side_by_side", spy)
    return threads


def test_the_side_by_side_path_is_the_one_taken(tmp_path, monkeypatch):
    """Two writer threads on a safetensors source; a streamed ``.pt`` source keeps
    the one-writer path."""
    threads = spy_writers(monkeypatch)
    writers(monkeypatch, 2)
    convert_checkpoint(
        sample("gpt.safetensors"), tmp_path / "a", LayoutOptions(world_size=4), sharded=True
    )
    assert threads == [2]
    convert_checkpoint(
        sample("gpt.pt"),
        tmp_path / "b",
        LayoutOptions(world_size=4),
        sharded=True,
        trust_pickle=True,
    )
    assert threads == [2]


def test_writer_threads_forces_the_count_whatever_the_machine(tmp_path, monkeypatch):
    """``writer_threads=1`` writes the rank files one after another (what
    ``benchmarks/bench_two_writers.py`` sets two writers against), ``2`` side by side,
    with the same bytes."""
    threads = spy_writers(monkeypatch)
    writers(monkeypatch, 1)
    src, layout = sample("gpt.safetensors"), LayoutOptions(world_size=4)
    convert_checkpoint(src, tmp_path / "two", layout, sharded=True, writer_threads=2)
    assert threads == [2]
    writers(monkeypatch, 2)
    convert_checkpoint(src, tmp_path / "one", layout, sharded=True, writer_threads=1)
    assert threads == [2]  # the one-writer path: no threads
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")


def test_a_failing_writer_stops_the_others_and_leaves_nothing(tmp_path, monkeypatch):
    """The second rank file's copy fails: the error reaches the caller once, every
    writer thread has ended, and no output (not even a temporary) is left."""
    real = copy_mod.Copier.copy
    calls = []

    def failing(self, src, dst_fd, dst_off, digest=None, tick=None):
        calls.append(src)
        if len(calls) == 3:
            raise CheckpointError(f"{src.path}: copy failed (injected)")
        return real(self, src, dst_fd, dst_off, digest, tick)

    monkeypatch.setattr(copy_mod.Copier, "copy", failing)
    writers(monkeypatch, 2)
    out = tmp_path / "out" / "set"
    out.parent.mkdir()
    for _ in range(10):  # the writers race differently each time
        calls.clear()
        with pytest.raises(CheckpointError, match="copy failed"):
            convert_checkpoint(
                sample("gpt.safetensors"), out, LayoutOptions(world_size=4), sharded=True
            )
        assert list(out.parent.iterdir()) == []
        assert not [t for t in parallel_ranks.threading.enumerate() if "yafsdp-writer" in t.name]


def test_shard_pieces_cuts_at_shard_boundaries_and_checks_lengths(tmp_path):
    f = tmp_path / "f"
    pieces = [FileRange(f, 0, 10), Zeros(4), FileRange(f, 100, 6)]
    assert shard_pieces("b", pieces, 5, 4) == [
        [FileRange(f, 0, 5)],
        [FileRange(f, 5, 5)],
        [Zeros(4), FileRange(f, 100, 1)],
        [FileRange(f, 101, 5)],
    ]
    with pytest.raises(CheckpointError, match="b: the data ended 5 bytes short"):
        shard_pieces("b", pieces, 5, 5)
    with pytest.raises(CheckpointError, match="b: the data is longer than the layout says"):
        shard_pieces("b", pieces, 4, 4)
