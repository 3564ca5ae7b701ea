"""`yafsdp convert`, `restore`, `reshard` through the CLI: output, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources

import jsonschema
import pytest
from checkpoint_helpers import assert_same_tensors, load_st, read_header, sample, write_raw
from conftest import ROOT
from typer.testing import CliRunner

from yafsdp_cli.checkpoint import INDEX_NAME
from yafsdp_cli.checkpoint import convert as convert_mod
from yafsdp_cli.cli import app

runner = CliRunner()
SCHEMA = json.loads(
    resources.files("yafsdp_cli").joinpath("schemas/checkpoint.schema.json").read_text()
)


def validated(text: str) -> dict:
    """The one JSON document in ``text``, checked against the published schema."""
    doc = json.loads(text)
    jsonschema.validate(doc, SCHEMA)
    return doc


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_convert_restore_reshard_happy_path(tmp_path):
    flat, folder, back = tmp_path / "f.safetensors", tmp_path / "set", tmp_path / "r.safetensors"
    src = sample("llama.safetensors")
    result = run("convert", src, "-o", flat, "--world-size", "4", "--verify")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())  # the terminal width folds lines
    assert text.startswith(f"wrote {flat} (one file") and "read back bit for bit" in text
    assert "22 parameters (106.82K elements) in 6 flat buffers" in text
    result = run("reshard", flat, "-n", "3", "--sharded", "-o", folder)
    assert result.exit_code == 0, result.output
    assert "rank-00002-of-00003.safetensors" in result.stdout
    result = run("restore", folder, "-o", back)
    assert result.exit_code == 0, result.output
    assert "restored 22 tensors" in result.stdout
    assert_same_tensors(load_st(src), load_st(back))


def test_a_long_output_path_is_printed_whole(tmp_path):
    """Rich folds a word longer than the console mid-name; a path must stay copyable."""
    deep = tmp_path / ("d" * 60) / ("e" * 30)
    deep.mkdir(parents=True)
    flat, back = deep / "f.safetensors", deep / "r.safetensors"
    result = run("convert", sample("llama.safetensors"), "-o", flat)
    assert result.exit_code == 0, result.output
    assert f"wrote {flat} (one file" in result.stdout
    result = run("restore", flat, "-o", back)
    assert result.exit_code == 0, result.output
    assert f"to {back} (" in result.stdout


def test_json_documents(tmp_path):
    flat, folder, back = tmp_path / "f.safetensors", tmp_path / "set", tmp_path / "r.pt"
    src = sample("gpt.safetensors")
    result = run("convert", src, "-o", flat, "-n", "2", "--align", "fsdp", "--verify", "--json")
    assert result.exit_code == 0, result.output
    doc = validated(result.stdout)  # exactly one document, nothing else on stdout
    assert doc["schema"] == "yafsdp.convert/1" and doc["written"] is True
    ck = doc["checkpoint"]
    assert ck["path"] == str(flat) and ck["world_size"] == 2 and ck["align"] == "fsdp"
    assert ck["nbytes"] == flat.stat().st_size and ck["checksum"] == "crc32"
    assert [f["checksums"] for f in ck["files"]] == [
        json.loads(read_header(flat)[0]["__metadata__"]["yafsdp.checksums"])
    ]
    assert doc["verify"]["ok"] is True and doc["verify"]["tensors"] == 28
    result = run("reshard", flat, "-n", "4", "--sharded", "-o", folder, "--json")
    doc = validated(result.stdout)
    assert doc["schema"] == "yafsdp.reshard/1" and doc["input_world_size"] == 2
    assert [f["rank"] for f in doc["checkpoint"]["files"]] == [0, 1, 2, 3]
    assert doc["checkpoint"]["index"] == str(folder / INDEX_NAME)
    result = run("restore", folder, "-o", back, "--json")
    doc = validated(result.stdout)
    assert doc["schema"] == "yafsdp.restore/1" and doc["format"] == "pt"
    assert doc["tied"] == {"transformer.wte.weight": "lm_head.weight"}
    assert doc["names"] == doc["tensors"] + 1 == 29
    del doc["tied"]
    with pytest.raises(jsonschema.ValidationError, match="'tied' is a required property"):
        jsonschema.validate(doc, SCHEMA)


def test_convert_with_model_filters_and_units(tmp_path):
    flat = tmp_path / "f.safetensors"
    result = run(
        "convert",
        sample("moe.safetensors"),
        "--model",
        "sample_models.models:moe",
        "--filter",
        "linear",
        "--unit",
        "blocks.*",
        "-o",
        flat,
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    names = [b["name"] for b in doc["checkpoint"]["buffers"]]
    assert names and all(".blocks." in n or n.startswith("__flat__.float") for n in names)
    kept = doc["checkpoint"]["kept"]
    assert kept and all(".norm." in n for n in kept)  # not linear: kept as they are


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["convert", "missing.safetensors", "-o", "{tmp}/o.safetensors"], "no such file"),
        (["convert", "{mlp}", "-o", "{tmp}/o.bin"], "a flat checkpoint is a .safetensors file"),
        (["convert", "{mlp}", "-o", "{tmp}/o.safetensors", "--filter", "linear"], "architecture"),
        (["convert", "{mlp}", "-o", "{mlp}", "--force"], "is the input"),
        (["restore", "{mlp}", "-o", "{tmp}/o.safetensors"], "not a yafsdp flat checkpoint"),
        (["reshard", "{tmp}", "-n", "2", "-o", "{tmp}/o.safetensors"], "without yafsdp.index"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    args = [a.format(tmp=tmp_path, mlp=sample("mlp.safetensors")) for a in args]
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
    assert not (tmp_path / "o.safetensors").exists()


def test_existing_output_without_force(tmp_path):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"x")
    result = run("convert", sample("mlp.safetensors"), "-o", out)
    assert result.exit_code == 2 and "pass --force" in result.stderr
    assert out.read_bytes() == b"x"
    assert run("convert", sample("mlp.safetensors"), "-o", out, "-f").exit_code == 0
    assert out.stat().st_size > 100_000


def test_tampered_file_is_refused_naming_the_buffer(tmp_path):
    flat = tmp_path / "f.safetensors"
    assert run("convert", sample("mlp.safetensors"), "-o", flat).exit_code == 0
    header, data = read_header(flat)
    data = bytearray(data)
    data[12345] ^= 0x10
    write_raw(flat, header, bytes(data))
    result = run("restore", flat, "-o", tmp_path / "r.safetensors")
    assert result.exit_code == 2
    assert "buffer '__flat__.float32' fails its checksum" in result.stderr
    assert not (tmp_path / "r.safetensors").exists()


def test_missing_rank_file_exit_2(tmp_path):
    folder = tmp_path / "set"
    assert (
        run("convert", sample("cnn.safetensors"), "-o", folder, "-n", "2", "--sharded").exit_code
        == 0
    )
    (folder / "rank-00001-of-00002.safetensors").unlink()
    result = run("reshard", folder, "-n", "4", "-o", tmp_path / "o.safetensors")
    assert result.exit_code == 2 and "rank 1's file" in result.stderr and "missing" in result.stderr


def test_failed_verify_exits_1_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(convert_mod, "equal_streams", lambda a, b: False)
    out = tmp_path / "o.safetensors"
    result = run("convert", sample("mlp.safetensors"), "-o", out, "--verify")
    assert result.exit_code == 1, result.output
    assert "nothing written" in result.stdout and "verify FAILED" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_mid_write_exits_130_and_leaves_nothing(tmp_path, monkeypatch):
    from yafsdp_cli.checkpoint import writer

    calls = []
    real = writer.FileWriter.put  # every piece (file range, zeros, bytes) goes through it

    def interrupted(self, piece, copier, tick=None):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        real(self, piece, copier, tick)

    monkeypatch.setattr(writer.FileWriter, "put", interrupted)
    result = run(
        "convert", sample("gpt.safetensors"), "-o", tmp_path / "set", "-n", "2", "--sharded"
    )
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_waits_a_second_and_is_quiet_off_a_terminal():
    from yafsdp_cli.cli import convert_cmd

    assert not convert_cmd.ProgressBar(True).enabled  # CliRunner's stderr is no terminal
    assert not convert_cmd.ProgressBar(False).enabled
    bar = convert_cmd.ProgressBar(True)
    bar.enabled = True
    bar("writing", 1, 10)
    assert bar.bar is None  # under a second: nothing shown
    bar.start -= 2
    with bar:
        bar("writing", 5, 10)
        bar("checking", 10, 10)
        assert set(bar.tasks) == {"writing", "checking"}
        assert bar.bar.tasks[bar.tasks["checking"]].completed == 10


def test_cli_convert_of_safetensors_does_not_import_torch(tmp_path):
    out = tmp_path / "f.safetensors"
    code = (
        "import sys\n"
        "from yafsdp_cli.cli import app\n"
        "try:\n"
        f"    app(['convert', {str(sample('gpt.safetensors'))!r}, '-o', {str(out)!r}, '--json'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "False"
    assert json.loads(proc.stdout)["written"] is True and out.is_file()


def _legacy_pickle(path):
    import torch

    torch.save({"a": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: p.write_bytes(sample("mlp.pt").read_bytes()), "a zip archive"),
        (_legacy_pickle, "a pickle"),
        (
            lambda p: p.write_bytes(sample("mlp.safetensors").read_bytes()),
            "its metadata has no 'yafsdp.format'",
        ),
        (lambda p: p.write_bytes(bytes(range(256)) * 8), "not a safetensors file"),
        (lambda p: p.mkdir(), "a folder without yafsdp.index.json"),
        (lambda p: p.write_text('{"model_type": "gpt2"}'), "a JSON file without 'format'"),
    ],
    ids=["torch-zip", "torch-pickle", "plain-safetensors", "random-bytes", "folder", "json"],
)
@pytest.mark.parametrize("command", ["restore", "reshard"])
def test_what_convert_did_not_write_is_named_in_one_line(tmp_path, make, what, command):
    """restore and reshard of a state dict (or anything else convert did not write)
    say what the input is and what they take, not how its bytes fail to parse."""
    src = tmp_path / ("in.json" if what.startswith("a JSON") else "weights.bin")
    make(src)
    out = tmp_path / "o.safetensors"
    args = (
        ["restore", src, "-o", out]
        if command == "restore"
        else [command, src, "-n", "2", "-o", out]
    )
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"{src} is not a yafsdp flat checkpoint ({what}" in lines[0], lines
    assert "restore and reshard take what `yafsdp convert` writes" in lines[0]
    assert "to read a state dict, use inspect or convert" in lines[0]
    assert "header length" not in lines[0]
    assert not out.exists()
