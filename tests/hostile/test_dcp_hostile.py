"""DCP metadata that costs out of proportion or hides in names: the tiling check
against a brute-force reference, its time on many chunks, bounded messages and
walks, names escaped on the terminal, and optimizer state keyed by position named
through ``--model`` (the corpus runs each bad folder through every command)."""

from __future__ import annotations

import itertools
import math
import random
import time

import pytest
from typer.testing import CliRunner

from yafsdp_cli.cli import app
from yafsdp_cli.engine import dtypes
from yafsdp_cli.errors import SourceError, excerpt, printable
from yafsdp_cli.sources.dcp_meta import _check_disjoint, read_dcp_metadata

from .dcp_cases import ESC, _many_chunks, _saved, _shared_lists, metadata, write_folder

runner = CliRunner()


# ------------------------------------------------------------ the tiling check


def _brute_disjoint(chunks) -> bool:
    """No two non-empty chunks share an element, pair by pair."""
    boxes = [c for c in chunks if math.prod(c[1])]
    for (a_off, a_size), (b_off, b_size) in itertools.combinations(boxes, 2):
        if all(
            a < b + n and b < a + m for a, m, b, n in zip(a_off, a_size, b_off, b_size, strict=True)
        ):
            return False
    return True


def _guillotine(rng: random.Random, lo: list[int], hi: list[int], out: list) -> None:
    """Cut the box ``[lo, hi)`` in two along a random dimension, again and again."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if not dims or rng.random() < 0.3:
        out.append((tuple(lo), tuple(h - low for low, h in zip(lo, hi, strict=True))))
        return
    d = rng.choice(dims)
    cut = rng.randint(lo[d] + 1, hi[d] - 1)
    _guillotine(rng, lo, [*hi[:d], cut, *hi[d + 1 :]], out)
    _guillotine(rng, [*lo[:d], cut, *lo[d + 1 :]], hi, out)


def _random_chunks(rng: random.Random, shape: tuple[int, ...]) -> list:
    """Chunks inside ``shape`` whose sizes add up to its size: a random tiling, often
    with one chunk moved (overlapping another) or swapped for random boxes."""
    chunks: list = []
    _guillotine(rng, [0] * len(shape), list(shape), chunks)
    kind = rng.random()
    if kind < 0.4 and chunks:  # move one chunk somewhere it still fits
        i = rng.randrange(len(chunks))
        _, size = chunks[i]
        chunks[i] = (tuple(rng.randint(0, d - s) for d, s in zip(shape, size, strict=True)), size)
    elif kind < 0.6:  # random boxes until the sizes add up (or give up)
        chunks, total = [], math.prod(shape)
        for _ in range(20):
            size = tuple(rng.randint(1, d) for d in shape)
            if math.prod(size) > total - sum(math.prod(s) for _, s in chunks):
                continue
            off = tuple(rng.randint(0, d - s) for d, s in zip(shape, size, strict=True))
            chunks.append((off, size))
    if rng.random() < 0.2:  # an empty shard (a rank with no rows) anywhere
        chunks.append((tuple(rng.randint(0, d) for d in shape), (0,) * len(shape)))
    rng.shuffle(chunks)
    return chunks


def _accepted(shape, chunks) -> bool:
    try:
        _check_disjoint("m", "t", shape, chunks)
    except SourceError as exc:
        assert "overlapping chunks" in str(exc), exc
        return False
    return True


def test_tiling_check_agrees_with_pairwise_comparison():
    rng = random.Random(46)
    tried = {True: 0, False: 0}
    for _ in range(4000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        chunks = _random_chunks(rng, shape)
        if sum(math.prod(s) for _, s in chunks) != math.prod(shape):
            continue  # the coverage count refuses these before the overlap check
        want = _brute_disjoint(chunks)
        assert _accepted(shape, chunks) == want, (shape, chunks)
        tried[want] += 1
    assert min(tried.values()) > 300, tried  # both answers were put to the test


def test_an_overlap_is_named_by_a_pair_of_offsets():
    chunks = [((0, 0), (70, 64)), ((60, 0), (48, 64)), ((118, 0), (10, 64))]
    with pytest.raises(SourceError, match=r"overlapping chunks at offsets \[0, 0\] and \[60, 0\]"):
        _check_disjoint("m", "t", (128, 64), chunks)


def test_many_chunks_split_along_a_later_dimension_are_checked_in_linear_time(tmp_path):
    """Every chunk starts at row 0, so a sweep along dim 0 alone compares them all
    with each other: 5,000 chunks took 23 s that way."""
    ck = _many_chunks(5000)(tmp_path)
    chunks = [((0, i), (1, 1)) for i in range(5000)]
    start = time.perf_counter()
    _check_disjoint("m", "t", (1, 5000), chunks)
    assert time.perf_counter() - start < 1.0
    assert read_dcp_metadata(ck).tensors["model.w"].chunks == 5000


def _staircase(k: int) -> list:
    """A valid tiling of ``[2] * k`` by ``k + 1`` chunks that line up nowhere: chunk i
    is 1 in its dims before i, 0 in dim i, and whole after it."""
    out = []
    for i in range(k + 1):
        off = tuple(1 if d < i else 0 for d in range(k))
        size = tuple(1 if d <= i else 2 for d in range(k))
        out.append((off, size))
    return out


def test_an_irregular_tiling_is_checked_or_refused_in_bounded_time():
    assert _accepted((2,) * 5, _staircase(5)) and _brute_disjoint(_staircase(5))
    start = time.perf_counter()
    with pytest.raises(SourceError, match="do not line up along any dimension, too irregular"):
        _check_disjoint("m", "t", (2,) * 40, _staircase(40))
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------ bounded messages


def test_shared_sub_lists_cost_a_short_message_not_their_expansion(tmp_path):
    ck = _shared_lists(tmp_path)
    start = time.perf_counter()
    with pytest.raises(SourceError, match="has a bad shape") as err:
        read_dcp_metadata(ck)
    assert time.perf_counter() - start < 1.0  # 4 s and a 29 MB message when written out
    assert len(str(err.value)) < 300, len(str(err.value))


def test_excerpt_is_bounded_whatever_the_value():
    shared: list = [1]
    for _ in range(60):
        shared = [shared, shared]
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in (shared, deep, 7**100_000, "x" * 10**6, {(1, 2): [b"\x1b" * 1000]}):
        text = excerpt(value)
        assert len(text) <= 80 and "\x1b" not in text, text
    assert excerpt([2**40, 2**40]) == "[1099511627776, 1099511627776]"


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable("model.layers.0.weight") == "model.layers.0.weight"
    assert printable("a\x1b[2Jb\x07\u202ec") == "a\\x1b[2Jb\\x07\\u202ec"
    assert printable("名前.weight") == "名前.weight"


def test_the_size_rule_of_every_reader():
    assert dtypes.shape_problem([2, 3], "float32") is None
    assert dtypes.shape_problem([0, 2**200], "float32") is None  # no elements, no bytes
    assert "more than 2^63 bytes" in dtypes.shape_problem([2**31, 2**31], "float32")
    assert "negative" in dtypes.shape_problem([-1], "float32")
    assert "whole numbers" in dtypes.shape_problem([True], "float32")
    assert "whole numbers" in dtypes.shape_problem([[1]], "float32")
    assert "more than 64" in dtypes.shape_problem([1] * 65, "float32")


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_inspect_refuses_a_shape_past_2_to_the_63_bytes_as_convert_does(tmp_path, args):
    ck = write_folder(tmp_path, metadata({"model.w": [2**40, 2**40]}))
    result = runner.invoke(app, ["inspect", str(ck), *args])
    assert result.exit_code == 2, result.output
    assert "float32 of that shape is more than 2^63 bytes" in result.stderr


# ------------------------------------------------------------ names on the terminal


@pytest.mark.parametrize("args", [[], ["--all"], ["--format", "markdown"]])
def test_inspect_escapes_control_characters_in_tensor_names(tmp_path, args):
    ck = write_folder(tmp_path, metadata({f"model.{ESC}w": [4, 4], "model.b": [4]}))
    result = runner.invoke(app, ["inspect", str(ck), *args])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output
    assert "\\x1b[2J" in result.output


# ------------------------------------------------------------ state keyed by position


FACTORY = "import torch\n\ndef make():\n    return torch.nn.Linear(4, 2)\n"


def _run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def test_optimizer_state_by_position_is_named_through_model(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from .dcp_cases import _positional

    ck = _saved(_positional)(tmp_path)
    (tmp_path / "linear_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back"
    done = _run("convert", ck, "--model", "linear_factory:make", "-o", flat)
    assert done.exit_code == 0, done.output
    done = _run("restore", flat, "--format", "dcp", "-o", back)
    assert done.exit_code == 0, done.output
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    names = ["optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg_sq", "model.weight"]
    shapes = {names[0]: (2, 4), names[1]: (2,), names[2]: (2, 4)}
    got = {}
    for folder in (ck, back):
        state = {n: torch.zeros(shapes[n]) for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        got[folder] = state
    for n in names:
        assert torch.equal(got[ck][n], got[back][n]) and got[ck][n].abs().sum() > 0, n


def test_optimizer_state_by_position_over_some_parameters_is_refused(tmp_path, monkeypatch):
    """Positions that do not cover ``parameters()`` cannot be named by its order."""
    pytest.importorskip("torch")

    def weight_only(model) -> dict:
        import torch

        opt = torch.optim.AdamW([model.weight], lr=1e-2)
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        return {"optimizer": opt.state_dict()}

    ck = _saved(weight_only)(tmp_path)
    (tmp_path / "linear_factory.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    done = _run("convert", ck, "--model", "linear_factory:make", "-o", tmp_path / "f.safetensors")
    assert done.exit_code == 2
    assert "the optimizer holds 1 parameters, but --model has 2" in " ".join(done.stderr.split())


def test_every_error_line_is_one_line_without_control_characters(tmp_path, monkeypatch):
    """Whatever a message quotes from a file, the line printed escapes it."""
    import yafsdp_cli.sources as sources

    def lying(*args, **kwargs):
        raise SourceError("x.bin: member a\x1b[2J\nb is damaged")

    monkeypatch.setattr(sources, "load_source", lying)
    src = tmp_path / "x.safetensors"
    src.write_bytes(b"")
    result = runner.invoke(app, ["inspect", str(src)])
    assert result.exit_code == 2
    line = result.stderr
    assert line.startswith("error: x.bin: member a\\x1b[2J") and line.count("\n") == 1, line
    assert "\x1b" not in line


def test_plain_text_on_the_consoles_is_escaped_line_by_line(capsys):
    """Notes and warnings (markup off) name files and tensors: each line is escaped,
    the line breaks we put there kept; markup text is ours and passes as it is."""
    from yafsdp_cli.cli.command_kit import LazyConsole

    console = LazyConsole(stderr=True, highlight=False, soft_wrap=True)
    console.print("note: \x1b]0;pwned\x07a.weight\nsecond line", markup=False)
    console.print("[bold]ours[/]", markup=True)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert err.splitlines() == ["note: \\x1b]0;pwned\\x07a.weight", "second line", "ours"]
