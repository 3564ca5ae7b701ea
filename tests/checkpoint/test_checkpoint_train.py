"""Training checkpoints: optimizer state through convert, reshard and restore, bit for
bit, in the source's own layout; old (version 1) flat files still read; bad state
refused with one line, exit 2 and nothing written."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import assert_same_tensors, read_header, train_steps
from dcp_samples import save_dcp, trained
from helpers import build
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from typer.testing import CliRunner

from yafsdp_cli.checkpoint import open_flat, restore_checkpoint
from yafsdp_cli.cli import app
from yafsdp_cli.options import LayoutOptions

runner = CliRunner()
FIXTURE = Path(__file__).parents[1] / "fixtures" / "flat-v1-mlp.safetensors"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def torchtitan_checkpoint(path: Path, name: str, *, flatten: bool, optimizer="adamw"):
    """``{"model", "optimizer", ...}`` as torchtitan saves it; returns model and optimizer."""
    model, opt = trained(name, optimizer, steps=2)
    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten)
    )
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_dcp(path, {"model": weights, "optimizer": osd, "train_state": {"step": 2}})
    return model, opt


def load_like_torchtitan(path: Path, name: str, *, flatten: bool, optimizer="adamw"):
    """A fresh model and optimizer filled by ``dcp.load({"model", "optimizer"})``."""
    model = build(name, seed=7)  # other weights than the checkpoint's
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt, options=options)
    state = {"model": sd, "optimizer": osd, "train_state": {"step": 0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def assert_same_optimizer(a: dict, b: dict) -> None:
    """Two optimizer state dicts (by parameter name) hold the same bits."""
    assert a.keys() == b.keys()
    if "state" in a:
        assert a["state"].keys() == b["state"].keys()
        for param, fields in a["state"].items():
            assert_same_tensors(fields, b["state"][param])
        assert a["param_groups"] == b["param_groups"]
        return
    tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
    assert_same_tensors(tensors, {k: b[k] for k in tensors})
    assert {k: v for k, v in a.items() if k not in tensors} == {
        k: v for k, v in b.items() if k not in tensors
    }


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "flattened"])
def test_dcp_training_checkpoint_round_trip_through_reshard(tmp_path, flatten):
    src, flat, re3, back = (tmp_path / n for n in ("src", "flat.safetensors", "re3", "back"))
    model, opt = torchtitan_checkpoint(src, "gpt", flatten=flatten)
    assert run("convert", src, "-o", flat, "--world-size", "4").exit_code == 0
    result = run("reshard", flat, "--world-size", "3", "--sharded", "-o", re3)
    assert result.exit_code == 0, result.output
    result = run("restore", re3, "-o", back, "--format", "dcp")
    assert result.exit_code == 0, result.output
    state = load_like_torchtitan(back, "gpt", flatten=flatten)
    assert_same_tensors(state["model"], model.state_dict())
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    assert_same_optimizer(state["optimizer"], get_optimizer_state_dict(model, opt, options=options))
    assert state["train_state"] == {"step": 2}


def test_state_buffers_share_their_parameters_layout(tmp_path):
    src, flat = tmp_path / "src", tmp_path / "flat"
    torchtitan_checkpoint(src, "mlp", flatten=False)
    assert run("convert", src, "-o", flat, "--world-size", "2", "--sharded").exit_code == 0
    ckpt = open_flat(flat)
    assert ckpt.optim.kind == "adam"
    (b,) = ckpt.layout.buffers
    names = {sb.name: sb for sb in ckpt.all_buffers}
    assert set(names) == {b.name, f"{b.name}@exp_avg", f"{b.name}@exp_avg_sq"}
    for tensors in ckpt.files:
        for name, sb in names.items():
            assert tensors[name].shape == (b.padded_numel // 2,)
            assert sb.entries == b.entries
    assert ckpt.verify() == 2 * 3  # every state buffer checksummed, padding checked
    header, _ = read_header(ckpt.file_paths[0])
    assert header["__metadata__"]["yafsdp.version"] == "2"
    assert json.loads(header["__metadata__"]["yafsdp.optimizer"])["kind"] == "adam"


def test_sgd_momentum_round_trip(tmp_path):
    src, flat, back = tmp_path / "src", tmp_path / "flat.safetensors", tmp_path / "back"
    model, opt = torchtitan_checkpoint(src, "mlp", flatten=False, optimizer="sgd")
    assert run("convert", src, "-o", flat, "--world-size", "3").exit_code == 0
    assert open_flat(flat).optim.kind == "sgd"
    assert run("restore", flat, "-o", back, "--format", "dcp").exit_code == 0
    state = load_like_torchtitan(back, "mlp", flatten=False, optimizer="sgd")
    assert_same_optimizer(state["optimizer"], get_optimizer_state_dict(model, opt))


def test_weights_only_is_version_1(tmp_path):
    src, flat = tmp_path / "src", tmp_path / "flat.safetensors"
    torchtitan_checkpoint(src, "mlp", flatten=False)
    assert run("convert", src, "-o", flat, "--weights-only").exit_code == 0
    header, _ = read_header(flat)
    assert header["__metadata__"]["yafsdp.version"] == "1"
    assert "yafsdp.optimizer" not in header["__metadata__"]
    assert open_flat(flat).optim is None


def test_version_1_file_still_reads(tmp_path):
    ckpt = open_flat(FIXTURE)
    assert ckpt.optim is None and ckpt.verify() == len(ckpt.files[0])
    out = tmp_path / "mlp.safetensors"
    restore_checkpoint(FIXTURE, out)
    from safetensors.torch import load_file

    assert_same_tensors(load_file(out), load_file("sample_models/mlp.safetensors"))
    result = run("reshard", FIXTURE, "--world-size", "3", "-o", tmp_path / "r.safetensors")
    assert result.exit_code == 0, result.output


def test_state_restore_needs_its_own_format(tmp_path):
    src, flat = tmp_path / "src", tmp_path / "flat.safetensors"
    torchtitan_checkpoint(src, "mlp", flatten=False)
    assert run("convert", src, "-o", flat).exit_code == 0
    out = tmp_path / "w.safetensors"
    result = run("restore", flat, "-o", out)
    assert result.exit_code == 2 and "--format dcp" in result.output and not out.exists()
    assert run("restore", flat, "-o", out, "--weights-only").exit_code == 0


def _edit_and_save(path: Path, edit) -> None:
    model, opt = trained("mlp", "adamw", steps=1)
    osd = get_optimizer_state_dict(model, opt)
    edit(osd)
    save_dcp(path, {"model": dict(model.state_dict()), "optimizer": osd})


def _drop_sq(osd):
    del osd["state"]["net.0.weight"]["exp_avg_sq"]


def _bad_step(osd):
    osd["state"]["net.2.bias"]["step"] = torch.tensor(5.0)


def _bad_shape(osd):
    osd["state"]["net.0.bias"]["exp_avg"] = torch.zeros(3)


def _rmsprop(osd):
    for fields in osd["state"].values():
        fields["square_avg"] = fields.pop("exp_avg_sq")
        del fields["exp_avg"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_sq, "'net.0.weight' has no 'exp_avg_sq'"),
        (_bad_step, "step count differs between parameters"),
        (_bad_shape, "'net.0.bias' has shape [3], but the parameter is [128]"),
        (_rmsprop, "belongs to RMSprop"),
    ],
    ids=["missing-exp_avg_sq", "step-differs", "shape", "unknown-optimizer"],
)
def test_bad_optimizer_state_is_refused(tmp_path, edit, message):
    src, flat = tmp_path / "src", tmp_path / "flat.safetensors"
    _edit_and_save(src, edit)
    result = run("convert", src, "-o", flat)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not flat.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def torch_save_checkpoint(path: Path, name: str) -> tuple:
    """``torch.save({"model", "optimizer", "epoch"})`` after two AdamW steps."""
    model, opt = trained(name, "adamw", steps=2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}, path)
    return model, opt


def test_torch_save_training_checkpoint_round_trip(tmp_path):
    src, flat, re3, back = (tmp_path / n for n in ("ckpt.pt", "flat.safetensors", "re3", "back.pt"))
    model, opt = torch_save_checkpoint(src, "gpt")
    result = run(
        "convert", src, "--model", "sample_models.models:gpt", "-o", flat, "--world-size", "2"
    )
    assert result.exit_code == 0, result.output
    assert run("reshard", flat, "--world-size", "3", "--sharded", "-o", re3).exit_code == 0
    result = run("restore", re3, "-o", back)
    assert result.exit_code == 0, result.output
    got = torch.load(back, weights_only=True)
    assert got.keys() == {"model", "optimizer", "epoch"} and got["epoch"] == 2
    assert_same_tensors(got["model"], model.state_dict())
    want = opt.state_dict()
    assert got["optimizer"]["param_groups"] == want["param_groups"]
    assert got["optimizer"]["state"].keys() == want["state"].keys()
    for pid, fields in want["state"].items():
        assert_same_tensors(got["optimizer"]["state"][pid], fields)
    # the restored dict resumes training: a fresh optimizer loads it as it is
    fresh = build("gpt", seed=3)
    fresh.load_state_dict(got["model"])
    torch.optim.AdamW(fresh.parameters(), lr=1e-2).load_state_dict(got["optimizer"])


def test_torch_save_optimizer_needs_an_architecture(tmp_path):
    src, flat = tmp_path / "ckpt.pt", tmp_path / "flat.safetensors"
    torch_save_checkpoint(src, "mlp")
    result = run("convert", src, "-o", flat)
    assert result.exit_code == 2
    assert "give the architecture with --model" in " ".join(result.output.split())
    assert not flat.exists()
    assert run("convert", src, "-o", flat, "--weights-only").exit_code == 0


def test_resume_after_reshard_continues_bit_exactly(tmp_path):
    """3 AdamW steps, saved as torchtitan does, converted for 4 ranks, resharded to 3,
    restored and loaded into a fresh model: 3 more steps give the losses of 6 steps
    run without a break (one process: the checkpoint path, not a sharded run)."""
    model = build("gpt")
    unbroken = train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 0, 6)
    model = build("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert train_steps(model, opt, 0, 3) == unbroken[:3]
    src, flat, re3, back = (tmp_path / n for n in ("src", "flat", "re3", "back"))
    save_dcp(src, {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)})
    assert run("convert", src, "-o", flat, "-n", "4", "--sharded").exit_code == 0
    assert run("reshard", flat, "-n", "3", "--sharded", "-o", re3).exit_code == 0
    assert run("restore", re3, "-o", back, "--format", "dcp").exit_code == 0
    fresh = build("gpt", seed=9)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    state = {"model": fresh.state_dict(), "optimizer": get_optimizer_state_dict(fresh, fresh_opt)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(back), no_dist=True)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optimizer"])
    assert train_steps(fresh, fresh_opt, 3, 3) == unbroken[3:]


def _flat_gpt(layout=None, seed=0):
    from yafsdp_cli import convert_module, plan, spec_from_module

    model = build("gpt", seed=seed)
    layout = layout or plan(spec_from_module(model), LayoutOptions(world_size=4))
    return model, convert_module(model, layout)


def test_flat_adamw_resumes_from_a_resharded_flat_checkpoint(tmp_path):
    """AdamW on the flat buffers: 3 steps, saved for 4 ranks, resharded to 3, loaded
    into another model converted with the new layout; 3 more steps give the losses
    of 6 unbroken steps (one process)."""
    from yafsdp_cli.checkpoint.flat_training import flat_adamw, save_flat_training

    model, flat = _flat_gpt()
    unbroken = train_steps(model, flat_adamw(flat, lr=1e-2), 0, 6)
    model, flat = _flat_gpt()
    opt = flat_adamw(flat, lr=1e-2)
    assert train_steps(model, opt, 0, 3) == unbroken[:3]
    save_flat_training(flat, opt, tmp_path / "run", sharded=True)
    assert (
        run("reshard", tmp_path / "run", "-n", "3", "--sharded", "-o", tmp_path / "re3").exit_code
        == 0
    )
    ckpt = open_flat(tmp_path / "re3")
    fresh, fresh_flat = _flat_gpt(ckpt.layout, seed=9)
    resumed = train_steps(fresh, flat_adamw(fresh_flat, ckpt, lr=0.5), 3, 3)  # its lr wins
    assert resumed == unbroken[3:]
    # restore gives the per-parameter form: each entry's slice of its buffer's state
    result = run("restore", tmp_path / "re3", "-o", tmp_path / "back.pt")
    assert result.exit_code == 0, result.output
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    b = fresh_flat.buffers[0]
    e = b.layout.entries[0]
    want = opt.state[flat.buffers[0].param]["exp_avg"][e.offset : e.offset + e.numel]
    assert torch.equal(back["optimizer"]["state"][e.name]["exp_avg"].reshape(-1), want)


def test_flat_adamw_refuses_a_weights_only_checkpoint(tmp_path):
    from yafsdp_cli import CheckpointError
    from yafsdp_cli.checkpoint.flat_training import flat_adamw

    _, flat = _flat_gpt()
    ckpt = open_flat(FIXTURE)  # weights only (and another model)
    with pytest.raises(CheckpointError, match="holds no AdamW state"):
        flat_adamw(flat, ckpt, lr=1e-2)


def test_torch_save_optimizer_over_some_parameters_is_refused(tmp_path):
    """Numbers that do not cover ``parameters()`` cannot be named by its order."""
    src, flat = tmp_path / "ckpt.pt", tmp_path / "flat.safetensors"
    model = build("mlp")
    opt = torch.optim.AdamW(list(model.parameters())[:4], lr=1e-2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    result = run("convert", src, "--model", "sample_models.models:mlp", "-o", flat)
    assert result.exit_code == 2 and not flat.exists()
    assert "the optimizer holds 4 parameters, but --model has 6" in " ".join(result.output.split())
