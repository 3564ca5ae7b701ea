"""Every source kind behind ``load_source``: safetensors files and index sets, torch
files (state dicts, training checkpoints, pickled modules, index sets), folders,
``--model`` factories, and every way a file can be hostile."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from tests.conftest import ROOT, SAMPLES
from yafsdp_cli import SourceError
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source

runner = CliRunner()


def write_raw(path: Path, header, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors-shaped file from a header (dict, or raw bytes) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def entry(dtype="F32", shape=(2,), begin=0, end=8) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def inspect_exit(path, *args) -> tuple[int, str]:
    result = runner.invoke(app, ["inspect", str(path), *args])
    return result.exit_code, result.stderr


# ---------------------------------------------------------------- safetensors


def test_safetensors_spec_and_bytes_round_trip(tmp_path):
    tensors = {
        "model.layers.0.mlp.w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "model.layers.1.mlp.w": torch.ones(3, 4, dtype=torch.bfloat16),
        "step": torch.tensor([7], dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    loaded = load_source(tmp_path / "m.safetensors")
    spec = loaded.spec
    assert [(t.name, t.shape, t.dtype, t.is_param) for t in spec.tensors] == [
        ("model.layers.0.mlp.w", (3, 4), "float32", True),
        ("model.layers.1.mlp.w", (3, 4), "bfloat16", True),
        ("step", (1,), "int64", False),  # not floating: not a parameter
    ]
    assert spec.units == ("model.layers.0", "model.layers.1")
    assert not spec.has_architecture and spec.metadata == {"format": "pt"}
    assert any("tied weights cannot be known" in n for n in spec.notes)
    for name, t in tensors.items():
        assert torch.equal(loaded.reader.load(name), t)
        chunks = b"".join(bytes(c) for c in loaded.reader.iter_bytes(name, chunk=5))
        assert chunks == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_safetensors_tied_names_from_save_model_metadata():
    loaded = load_source(SAMPLES / "gpt.safetensors")
    by_name = loaded.spec.by_name()
    record = by_name["transformer.wte.weight"]
    assert record is by_name["lm_head.weight"]
    assert set(record.names) == {"lm_head.weight", "transformer.wte.weight"}
    assert loaded.stored_name(record) in loaded.reader.names()


def test_safetensors_header_only_no_data_is_read(tmp_path):
    """A 20 GB sparse file: the header is read, the (unallocated) data never is."""
    path = write_raw(tmp_path / "big.safetensors", {"w": entry("BF16", (10, 2**30), 0, 20 * 2**30)})
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + 20 * 2**30)
    spec = load_source(path).spec
    assert spec.tensors[0].numel == 10 * 2**30
    assert os.stat(path).st_blocks * 512 < 2**20  # still sparse: nothing written or read


HOSTILE = {
    "too short": (b"\x01\x02", None, "not a safetensors file \\(only 2 bytes\\)"),
    "length beyond file": (None, 10**6, "header length 1000000 is impossible for a"),
    "not json": (b"{nope", None, "header is not valid JSON"),
    "not utf-8": (b"\xff\xfe{}", None, "header is not valid UTF-8"),
    "not an object": (b"[1, 2]", None, "header is not a JSON object"),
    "duplicate names": (b'{"a": 1, "a": 2}', None, "header names tensor 'a' twice"),
    "entry not object": ({"a": [1]}, None, "entry 'a' is not an object"),
    "bad dtype": ({"a": entry("F33")}, None, "tensor 'a' has unknown dtype 'F33'"),
    "missing dtype": ({"a": {"shape": [2], "data_offsets": [0, 8]}}, None, "unknown dtype None"),
    "negative dim": ({"a": entry(shape=(-2,))}, None, "tensor 'a' has a bad shape"),
    "bool dim": ({"a": {**entry(), "shape": [True]}}, None, "tensor 'a' has a bad shape"),
    "offsets reversed": ({"a": entry(begin=8, end=0)}, None, "bad data_offsets \\[8, 0\\]"),
    "offsets not a pair": ({"a": {**entry(), "data_offsets": [0]}}, None, "bad data_offsets"),
    "size mismatch": ({"a": entry(shape=(3,))}, None, "spans 8 bytes, but float32\\[3\\] needs 12"),
    "out of range": ({"a": entry(shape=(4,), end=16)}, None, "truncated: the header describes 16"),
    "overlap": (
        {"a": entry(), "b": entry(begin=4, end=12)},
        None,
        "tensor 'b' at offset 4 overlaps the previous tensor",
    ),
    "hole": ({"a": entry(begin=8, end=16)}, None, "tensor 'a' at offset 8 leaves a hole at 0"),
    "short header": ({}, None, "the header covers only 0 bytes of data, the file has 8"),
    "bad metadata": ({"__metadata__": {"k": 1}, "a": entry()}, None, "must map strings to str"),
}


def hostile_file(tmp_path: Path, case: str) -> Path:
    header, length, _ = HOSTILE[case]
    path = tmp_path / "bad.safetensors"
    if case == "too short":
        path.write_bytes(header)
        return path
    if header is None:
        header = {"a": entry()}
    return write_raw(path, header, b"\0" * 8, length)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_safetensors_headers_are_refused(tmp_path, case):
    path = hostile_file(tmp_path, case)
    before = path.read_bytes()
    with pytest.raises(SourceError, match=HOSTILE[case][2]):
        load_source(path)
    code, err = inspect_exit(path)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert path.read_bytes() == before  # the input is never modified


def test_header_over_100_mb_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    n = 100 * 1024 * 1024 + 1
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n + 64)  # sparse: the length fits the file, but is over the limit
    with pytest.raises(SourceError, match=f"header length {n} is impossible"):
        load_source(path)


def test_truncated_data_is_found_when_reading(tmp_path):
    """A file that shrinks after its header was checked fails cleanly on read."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(1000)}, path)
    loaded = load_source(path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(SourceError, match="ended inside tensor 'a' \\(truncated file\\)"):
        loaded.reader.load("a")


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2)}, path)
    real_open = open

    def deny(file, *args, **kwargs):
        if Path(file) == path:
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(SourceError, match="m.safetensors: cannot read \\(Permission denied\\)"):
        load_source(path)


# ---------------------------------------------------------------- index sets


def write_index_set(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {
        "model.layers.0.mlp.w": torch.randn(4, 4),
        "model.layers.1.mlp.w": torch.randn(4, 4),
        "model.norm.weight": torch.randn(4),
    }
    shards = {"model-00001-of-00002.safetensors": list(tensors)[:2]}
    shards["model-00002-of-00002.safetensors"] = list(tensors)[2:]
    weight_map = {}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, folder / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_index_set_reads_every_shard(tmp_path):
    tensors = write_index_set(tmp_path)
    loaded = load_source(tmp_path / "model.safetensors.index.json")
    assert [t.name for t in loaded.spec.tensors] == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded.reader.load(name), t)
    assert load_source(tmp_path).spec == loaded.spec  # the folder finds its index


def edit_index(folder: Path, change) -> Path:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index)
    path.write_text(json.dumps(index))
    return path


INDEX_CASES = {
    "missing shard": (
        lambda i: i["weight_map"].update({"model.norm.weight": "gone.safetensors"}),
        "weight_map names 'gone.safetensors', which does not exist",
    ),
    "wrong shard": (
        lambda i: i["weight_map"].update(
            {"model.layers.1.mlp.w": "model-00002-of-00002.safetensors"}
        ),
        "puts 'model.layers.1.mlp.w' in model-00002-of-00002.safetensors, but it is in model-00001",
    ),
    "shard left out": (
        lambda i: i["weight_map"].update({"model.norm.weight": "model-00001-of-00002.safetensors"}),
        "puts 'model.norm.weight' in model-00001-of-00002.safetensors, but no shard it names has",
    ),
    "tensor nowhere": (
        lambda i: i["weight_map"].update({"ghost": "model-00001-of-00002.safetensors"}),
        "weight_map puts 'ghost' in .* but no shard it names has it",
    ),
    "unnamed tensor": (
        lambda i: i["weight_map"].pop("model.layers.1.mlp.w"),
        "shards hold tensors the weight_map does not name: \\['model.layers.1.mlp.w'\\]",
    ),
    "no weight_map": (lambda i: i.pop("weight_map"), "no weight_map; is this a safetensors index"),
    "outside folder": (
        lambda i: i["weight_map"].update({"model.norm.weight": "../elsewhere.safetensors"}),
        "names '../elsewhere.safetensors', outside its folder",
    ),
}


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_bad_index_sets_are_refused(tmp_path, case):
    write_index_set(tmp_path)
    change, message = INDEX_CASES[case]
    path = edit_index(tmp_path, change)
    with pytest.raises(SourceError, match=message):
        load_source(path)
    code, err = inspect_exit(path)
    assert code == 2 and err.count("\n") == 1, err


def test_index_that_is_not_json(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text("{")
    with pytest.raises(SourceError, match="not valid JSON"):
        load_source(path)


# ---------------------------------------------------------------- paths and folders


def test_unknown_and_missing_paths(tmp_path):
    with pytest.raises(SourceError, match="nope.safetensors: no such file or folder"):
        load_source(tmp_path / "nope.safetensors")
    (tmp_path / "notes.txt").write_text("hello world")
    with pytest.raises(SourceError, match="unknown file type; expected .safetensors"):
        load_source(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="a folder with neither config.json nor model weights"):
        load_source(tmp_path / "empty")
    with pytest.raises(SourceError, match="give a SOURCE file or folder, or --model"):
        load_source(None)
    for path in (tmp_path / "nope.pt", tmp_path / "notes.txt", tmp_path / "empty"):
        code, err = inspect_exit(path)
        assert code == 2 and err.count("\n") == 1, err


def test_content_sniffing_without_a_suffix(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "weights")
    assert load_source(tmp_path / "weights").spec.source_kind == "safetensors"
    torch.save({"a": torch.ones(2)}, tmp_path / "weights2")
    assert load_source(tmp_path / "weights2").spec.source_kind == "state dict"


def test_folder_with_several_safetensors_and_no_index(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"b": torch.ones(2)}, tmp_path / "b.safetensors")
    with pytest.raises(SourceError, match="several safetensors files and no index"):
        load_source(tmp_path)


# ---------------------------------------------------------------- import weight


def test_inspecting_safetensors_does_not_import_torch():
    code = (
        "import sys\n"
        "from yafsdp_cli.cli import main\n"
        f"sys.argv = ['yafsdp', 'inspect', {str(SAMPLES / 'llama.safetensors')!r}, '--json']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "sys.stderr.write('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout)["schema"] == "yafsdp.inspect/1"
    assert out.stderr.strip().endswith("HEAVY="), out.stderr
