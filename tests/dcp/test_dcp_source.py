"""DCP folders as a source: names from the metadata alone, torchtitan's layouts, the
optimizer state counted, and hostile folders refused with one line."""

from __future__ import annotations

import json
import pickle
from importlib import resources

import jsonschema
import pytest
import torch
from dcp_samples import save_dcp, trained, training_checkpoint
from typer.testing import CliRunner

from yafsdp_cli import SourceError
from yafsdp_cli.cli import app
from yafsdp_cli.sources import load_source
from yafsdp_cli.sources.dcp_folder import DcpReader

runner = CliRunner()
SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/inspect.schema.json").read_text()
)


def inspect_json(*args) -> dict:
    result = runner.invoke(app, ["inspect", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    return doc


@pytest.fixture(scope="module")
def gpt_dcp(tmp_path_factory):
    """The sample GPT after one AdamW step, saved as torchtitan does (nested)."""
    path = tmp_path_factory.mktemp("dcp") / "step-1"
    return path, training_checkpoint(path, "gpt")


def test_names_shapes_dtypes_come_from_the_metadata_alone(gpt_dcp, monkeypatch):
    path, weights = gpt_dcp
    from torch.distributed.checkpoint import FileSystemReader

    def no_data(*args, **kwargs):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(FileSystemReader, "read_data", no_data)
    monkeypatch.setattr(DcpReader, "load", no_data)
    doc = inspect_json(path)
    entries = {e["name"]: e for b in doc["buffers"] for e in b["entries"]}
    assert doc["source_kind"] == "dcp" and sorted(entries) == sorted(weights)
    for name, t in weights.items():  # the "model." prefix of the nested state is dropped
        assert entries[name]["shape"] == list(t.shape) and entries[name]["dtype"] == "float32"
    assert any("'model' entry" in n for n in doc["notes"])


def test_optimizer_state_is_measured_and_decides_the_optimizer(gpt_dcp):
    path, weights = gpt_dcp
    doc = inspect_json(path)
    state = doc["checkpoint_state"]
    groups = {g["name"]: g for g in state["checkpoint"]["optimizer"]}
    # AdamW keeps exp_avg and exp_avg_sq per parameter; the tied lm_head has none
    unique = sum(t.numel() for n, t in weights.items() if n != "lm_head.weight")
    assert groups["exp_avg"]["numel"] == groups["exp_avg_sq"]["numel"] == unique
    assert groups["step"]["tensors"] == len(weights) - 1
    assert state["measured_state_bytes"] == 2 * 4 * unique
    assert state["checkpoint"]["without_state"] == ["lm_head.weight"]
    assert state["optimizer_from_checkpoint"] and doc["inputs"]["optimizer"] == "adamw"
    # without an architecture the tie is unknown, so the model counts lm_head too
    assert state["modeled_state_bytes"] == 2 * 4 * sum(t.numel() for t in weights.values())
    assert [g["name"] for g in state["checkpoint"]["other"]] == ["lr_scheduler"]
    # the architecture knows the tie: measured and modeled agree
    doc = inspect_json(path, "--model", "sample_models.models:gpt")
    assert doc["checkpoint_state"]["modeled_state_bytes"] == 2 * 4 * unique
    assert not any("they differ" in n for n in doc["notes"])
    assert any("counts 964,608 B" in n for n in doc["notes"])  # the GPT's 120,576 elements
    table = runner.invoke(app, ["inspect", str(path), "--format", "markdown"]).stdout
    assert "| optimizer | exp_avg | 28 | 471.00 KiB | float32 |" in table  # 120,576 x 4 B
    # an explicit --optimizer wins, and the difference is said
    doc = inspect_json(path, "--optimizer", "sgd")
    assert doc["inputs"]["optimizer"] == "sgd" and any("they differ" in n for n in doc["notes"])


def test_sgd_state_and_model_keys_at_the_top_level(tmp_path):
    path = tmp_path / "ck"
    weights = training_checkpoint(path, "mlp", nested=False, optimizer="sgd")
    doc = inspect_json(path)
    names = sorted(e["name"] for b in doc["buffers"] for e in b["entries"])
    assert names == sorted(weights)  # optimizer, lr_scheduler, train_state are not weights
    assert doc["checkpoint_state"]["checkpoint"]["model_key"] is None
    assert doc["inputs"]["optimizer"] == "sgd"
    assert doc["checkpoint_state"]["measured_state_bytes"] == 4 * sum(
        t.numel() for t in weights.values()
    )


def test_weights_only_checkpoint_and_hf_style_names(tmp_path):
    """A plain ``dcp.save(model.state_dict())`` with names that start with ``model.``
    keeps them: only a nested entry's prefix is dropped."""
    state = {"model.embed.weight": torch.randn(4, 3), "lm_head.weight": torch.randn(5, 3)}
    save_dcp(tmp_path / "ck", state)
    loaded = load_source(tmp_path / "ck")
    assert sorted(loaded.reader.names()) == sorted(state)
    for name, t in state.items():
        assert torch.equal(loaded.reader.load(name), t)
    doc = inspect_json(tmp_path / "ck")
    assert doc["checkpoint_state"]["checkpoint"]["optimizer"] == []
    assert doc["inputs"]["optimizer"] == "adamw"  # nothing to take: the default


def test_reader_assembles_chunks_of_every_dtype(tmp_path):
    state = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.tensor(2.5, dtype=torch.float64),
        "d": torch.empty(0, 4),
        "e": torch.randn(6).half(),
    }
    save_dcp(tmp_path / "ck", state)
    loaded = load_source(tmp_path / "ck" / ".metadata")  # the metadata file names its folder
    for name, t in state.items():
        got = loaded.reader.load(name)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name
        assert loaded.reader.nbytes(name) == t.numel() * t.element_size()
        assert b"".join(bytes(c) for c in loaded.reader.iter_bytes(name, 5)) == (
            t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )


# ------------------------------------------------------------ hostile folders


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "ck"
    model, _ = trained("mlp", steps=0)
    save_dcp(path, {"model": model.state_dict()})
    return path


def _metadata(path):
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # noqa: S301 (our own test file)


def _rewrite(path, md) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


def refused(path, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        load_source(path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch PWNED",))


def test_a_metadata_pickle_that_would_run_code_is_refused(small, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (small / ".metadata").write_bytes(pickle.dumps(_Payload()))
    refused(small, r"names (posix|os)\.system, which a torch.distributed.checkpoint")
    assert not (tmp_path / "PWNED").exists()


def test_truncated_or_foreign_metadata(small):
    data = (small / ".metadata").read_bytes()
    (small / ".metadata").write_bytes(data[: len(data) // 2])
    refused(small, "not a readable torch.distributed.checkpoint metadata file")
    (small / ".metadata").write_bytes(pickle.dumps({"a": 1}))
    refused(small, "not a torch.distributed.checkpoint Metadata object")


def test_missing_or_truncated_data_file(small):
    data = small / "__0_0.distcp"
    blob = data.read_bytes()
    data.write_bytes(blob[:-100])
    refused(small, r"needs bytes up to \d+, but the file has \d+ \(truncated\)")
    data.unlink()
    refused(small, r"stored in __0_0.distcp, which is missing")


def test_chunks_that_leave_a_hole_or_overlap(small):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md = _metadata(small)
    fqn = "model.net.0.weight"  # (128, 64)
    md.state_dict_metadata[fqn].chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([100, 64]))
    ]
    _rewrite(small, md)
    refused(small, r"chunks of tensor .model.net.0.weight. cover 6400 of its 8192 elements")
    md.state_dict_metadata[fqn].chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([70, 64])),
        ChunkStorageMetadata(torch.Size([60, 0]), torch.Size([48, 64])),  # a hole at 108
        ChunkStorageMetadata(torch.Size([118, 0]), torch.Size([10, 64])),
    ]
    _rewrite(small, md)
    refused(small, r"overlapping chunks at offsets \[0, 0\] and \[60, 0\]")
    md.state_dict_metadata[fqn].chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([129, 64]))
    ]
    _rewrite(small, md)
    refused(small, "has a chunk outside it")


def test_storage_outside_the_folder_or_a_lying_dtype(small):
    md = _metadata(small)
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    _rewrite(small, md)
    refused(small, r"stored in '../elsewhere.distcp', outside the checkpoint folder")
    md = _metadata(small)
    md.state_dict_metadata["model.net.0.weight"].properties.dtype = torch.complex128
    _rewrite(small, md)
    refused(small, "unsupported dtype")


def test_corrupt_chunk_bytes_fail_on_read_not_silently(small, tmp_path):
    data = small / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[40:80] = b"\xff" * 40  # inside the first chunk's zip record
    data.write_bytes(bytes(blob))
    out = tmp_path / "flat.safetensors"
    result = runner.invoke(app, ["convert", str(small), "-o", str(out)])
    assert result.exit_code == 2 and "failed" in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing left behind


def test_a_data_file_alone_and_a_checkpoint_without_weights(small, tmp_path):
    refused(small / "__0_0.distcp", "one rank's part of a torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt = trained("mlp")
    save_dcp(tmp_path / "opt", {"optimizer": get_optimizer_state_dict(model, opt)})
    refused(tmp_path / "opt", "a DCP checkpoint with no model weights")
