"""Hugging Face Trainer checkpoint folders: weights, optimizer.pt and every other file
through convert, reshard and restore, byte for byte; the restored folder resumes
training as the original does; bad state refused with one line, exit 2 and nothing
written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from checkpoint_helpers import assert_same_tensors, read_header, write_raw  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from yafsdp_cli.checkpoint import open_flat  # noqa: E402
from yafsdp_cli.cli import app  # noqa: E402

runner = CliRunner()
STEPS = 4  # the unbroken run; checkpoint-2 is resumed for steps 3 and 4


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def train(out: Path, *, steps=STEPS, resume: Path | None = None, frozen: str | None = None):
    """A tiny Llama trained by ``transformers.Trainer`` on the CPU, saving every 2
    steps; returns {step: logged loss} (a resumed run's history starts with the
    checkpoint's)."""
    import transformers as tf
    from dcp_helpers import tiny_llama
    from hf_models import VOCAB

    tf.set_seed(0)
    model = tiny_llama()
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (8,), generator=gen)} for _ in range(16)]
    for sample in data:
        sample["labels"] = sample["input_ids"].clone()
    args = tf.TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        save_steps=2,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.1,  # the two param groups differ
        seed=0,
        dataloader_num_workers=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = tf.Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """checkpoint-2 of a 4-step run, and the run's losses."""
    out = tmp_path_factory.mktemp("trainer")
    losses = train(out / "run")
    return out / "run" / "checkpoint-2", losses


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def assert_same_folder(a: Path, b: Path) -> None:
    """Same file names, every file's bytes equal."""
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert p.read_bytes() == (b / p.name).read_bytes(), p.name


def assert_same_optimizer(a: Path, b: Path) -> None:
    """Two optimizer.pt files: same numbers, param groups and state tensors' bits."""
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert sa["param_groups"] == sb["param_groups"]
    assert list(sa["state"]) == list(sb["state"])
    for pid, fields in sa["state"].items():
        assert_same_tensors(fields, sb["state"][pid])


@pytest.mark.parametrize(
    ("first", "second"),
    [(["-n", "4"], ["-n", "3", "--sharded"]), (["-n", "2", "--sharded"], ["-n", "3"])],
    ids=["file-to-set", "set-to-file"],
)
def test_trainer_folder_round_trip_through_reshard(trained, tmp_path, first, second):
    folder, _ = trained
    flat = tmp_path / ("flat" if "--sharded" in first else "flat.safetensors")
    again = tmp_path / ("re3" if "--sharded" in second else "re3.safetensors")
    result = run("convert", folder, "-o", flat, *first)
    assert result.exit_code == 0, result.output
    ckpt = open_flat(flat)
    assert (ckpt.optim.form, ckpt.optim.kind) == ("trainer", "adam")
    assert "scheduler.pt" in ckpt.optim.files and "optimizer.pt" not in ckpt.optim.files
    assert run("reshard", flat, *second, "-o", again).exit_code == 0
    back = tmp_path / "back"
    result = run("restore", again, "-o", back, "--format", "trainer")
    assert result.exit_code == 0, result.output
    assert_same_tensors(
        load_file(back / "model.safetensors"), load_file(folder / "model.safetensors")
    )
    assert_same_optimizer(back / "optimizer.pt", folder / "optimizer.pt")
    assert_same_folder(back, folder)  # optimizer.pt and model.safetensors included


def test_resumed_from_the_restored_folder_trains_as_the_unbroken_run(trained, tmp_path):
    folder, unbroken = trained
    flat, back = tmp_path / "flat", tmp_path / "checkpoint-2"
    assert run("convert", folder, "-o", flat, "-n", "4", "--sharded").exit_code == 0
    assert run("restore", flat, "-o", back, "--format", "trainer").exit_code == 0
    resumed = train(tmp_path / "resumed", resume=back)
    assert list(unbroken) == [1, 2, 3, 4] and resumed == unbroken
    control = train(tmp_path / "control", resume=folder)  # the original folder, resumed
    assert control == unbroken


def test_sharded_weights_come_back_as_the_same_shards(trained, tmp_path):
    from dcp_helpers import tiny_llama

    folder = copy_of(trained[0], tmp_path)
    model = tiny_llama()
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back"
    assert run("convert", folder, "-o", flat, "-n", "2").exit_code == 0
    result = run("restore", flat, "-o", back, "--format", "trainer")
    assert result.exit_code == 0, result.output
    assert_same_folder(back, folder)


def test_weights_only_keeps_the_weights_alone(trained, tmp_path):
    folder, _ = trained
    flat, out = tmp_path / "flat.safetensors", tmp_path / "w.safetensors"
    assert run("convert", folder, "-o", flat, "--weights-only").exit_code == 0
    assert open_flat(flat).optim is None
    result = run("restore", flat, "-o", tmp_path / "back", "--format", "trainer")
    assert result.exit_code == 2 and "it holds none" in result.output
    assert run("restore", flat, "-o", out).exit_code == 0
    assert_same_tensors(load_file(out), load_file(folder / "model.safetensors"))


def test_a_trainer_checkpoint_restores_only_as_a_trainer_folder(trained, tmp_path):
    flat, out = tmp_path / "flat.safetensors", tmp_path / "w.safetensors"
    assert run("convert", trained[0], "-o", flat).exit_code == 0
    result = run("restore", flat, "-o", out)
    assert result.exit_code == 2 and "--format trainer" in result.output and not out.exists()
    assert run("restore", flat, "-o", out, "--weights-only").exit_code == 0
    stranger = tmp_path / "taken"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    result = run("restore", flat, "-o", stranger, "--format", "trainer", "--force")
    assert result.exit_code == 2 and "never replaced" in result.output
    assert [p.name for p in stranger.iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------- refusals


def _edit_optimizer(edit):
    def apply(folder: Path) -> None:
        osd = torch.load(folder / "optimizer.pt", weights_only=True)
        edit(osd)
        torch.save(osd, folder / "optimizer.pt")

    return apply


def _drop_sq(osd):
    del osd["state"][0]["exp_avg_sq"]


def _bad_shape(osd):
    osd["state"][1]["exp_avg"] = torch.zeros(3)


def _rmsprop(osd):
    for fields in osd["state"].values():
        fields["square_avg"] = fields.pop("exp_avg_sq")
        del fields["exp_avg"]


def _one_group(osd):
    first, second = osd["param_groups"]
    first["params"] += second["params"]
    del osd["param_groups"][1]


def _subfolder(folder: Path) -> None:
    (folder / "runs").mkdir()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_edit_optimizer(_drop_sq), "'model.embed_tokens.weight' has no 'exp_avg_sq'"),
        (
            _edit_optimizer(_bad_shape),
            "'exp_avg' of 'model.layers.0.self_attn.q_proj.weight' has shape [3], "
            "but the parameter is [32, 32]",
        ),
        (_edit_optimizer(_rmsprop), "belongs to RMSprop"),
        (_edit_optimizer(_one_group), "param groups of [20] parameters, but"),
        (_subfolder, "runs is not a file"),
    ],
    ids=["missing-exp_avg_sq", "shape", "unknown-optimizer", "groups", "subfolder"],
)
def test_bad_trainer_folder_is_refused(trained, tmp_path, edit, message):
    folder = copy_of(trained[0], tmp_path)
    edit(folder)
    assert_refused(folder, tmp_path, message)


def assert_refused(folder: Path, tmp_path: Path, message: str) -> None:
    flat = tmp_path / "flat.safetensors"
    result = run("convert", folder, "-o", flat)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not flat.exists() and [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert run("convert", folder, "-o", flat, "--weights-only").exit_code == 0


def test_a_parameter_frozen_at_save_time_is_refused(tmp_path):
    """The Trainer leaves a frozen parameter out of its groups; the architecture built
    from config.json has it trainable, so the groups do not match."""
    train(tmp_path / "run", steps=2, frozen="model.norm.weight")
    folder = Path(shutil.move(tmp_path / "run" / "checkpoint-2", tmp_path / "checkpoint-2"))
    shutil.rmtree(tmp_path / "run")
    assert_refused(folder, tmp_path, "param groups of [15, 4] parameters, but the Trainer's")


def test_carried_files_are_bounded(trained, tmp_path, monkeypatch):
    from yafsdp_cli.sources import trainer_folder

    monkeypatch.setattr(trainer_folder, "MAX_FILES_BYTES", 10_000)
    folder = copy_of(trained[0], tmp_path)
    assert_refused(folder, tmp_path, "(rng_state.pth: 14")


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda files: files.update({"../evil": files.pop("scheduler.pt")}), "no plain file name"),
        (
            lambda files: files["scheduler.pt"].update(base64="AAAA"),
            "scheduler.pt does not match its checksum",
        ),
        (lambda files: files.update({"optimizer.pt": files["scheduler.pt"]}), "a file twice"),
    ],
    ids=["path", "bytes", "optimizer.pt"],
)
def test_a_forged_file_record_is_refused(trained, tmp_path, forge, message):
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back"
    assert run("convert", trained[0], "-o", flat).exit_code == 0
    header, data = read_header(flat)
    record = json.loads(header["__metadata__"]["yafsdp.optimizer"])
    forge(record["files"])
    header["__metadata__"]["yafsdp.optimizer"] = json.dumps(record)
    write_raw(flat, header, data)
    result = run("restore", flat, "-o", back, "--format", "trainer")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and not back.exists()
    assert not (tmp_path.parent / "evil").exists()


def test_without_transformers_the_optimizer_is_not_dropped(trained, tmp_path, monkeypatch):
    """Read as its safetensors alone, a Trainer folder is refused, not stripped."""
    import sys

    folder = copy_of(trained[0], tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert_refused(folder, tmp_path, "needs the architecture (config.json is here but")
