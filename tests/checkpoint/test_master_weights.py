"""Float32 master weights of a mixed-precision run: read as the optimizer state field
``master_param`` (Transformer Engine) or ``fp32_param`` (Megatron-core), carried as
flat master buffers through convert, reshard and restore bit for bit, and resumed by
``flat_adamw``/``sharded_adamw`` bit for bit; what is not understood is refused with
one line, exit 2 and nothing written.

The runs are the sample Llama (bfloat16 matrices, float32 RMSNorm weights) under a
plain-torch AdamW that keeps its state as Transformer Engine's
``FusedAdam(master_weights=True)`` does: a float32 master for each bfloat16 parameter,
none for the float32 ones, which step themselves."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import assert_same_tensors, read_header, train_steps
from dcp_samples import save_dcp
from helpers import build
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from typer.testing import CliRunner

from yafsdp_cli import CheckpointError, convert_module, plan, spec_from_module
from yafsdp_cli.checkpoint import open_flat
from yafsdp_cli.checkpoint.flat_training import MasterAdamW, flat_adamw, save_flat_training
from yafsdp_cli.cli import app
from yafsdp_cli.options import LayoutOptions

runner = CliRunner()
LR = 1e-2
MODEL = "sample_models.models:llama"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


class MasterWeightsAdamW(torch.optim.Optimizer):
    """Mixed-precision AdamW in plain torch: each parameter narrower than float32 has a
    float32 master (state field ``field``) that AdamW steps with the parameter's
    gradient and that is rounded into the parameter after each step."""

    def __init__(self, params, field: str = "master_param", **hyper):
        params = list(params)
        self.field = field
        self.masters = [p.detach().float() if p.dtype != torch.float32 else p for p in params]
        self.inner = torch.optim.AdamW(self.masters, **hyper)
        super().__init__(params, self.inner.defaults)

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        for p, m in zip(params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, m in zip(params, self.masters):
            if m is not p:
                p.copy_(m)
            extra = {self.field: m} if m is not p else {}
            self.state[p] = {**self.inner.state[m], **extra}


def trained(steps: int, field: str = "master_param"):
    model = build("llama")
    opt = MasterWeightsAdamW(model.parameters(), field=field, lr=LR)
    return model, opt, train_steps(model, opt, 0, steps)


def dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder by its flattened key, read by torch's own loader."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(path)).read_metadata()
    out = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def save_masters_dcp(path: Path, model, opt, *, flatten: bool = False) -> None:
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    osd = get_optimizer_state_dict(model, opt, options=options)
    save_dcp(path, {"model": dict(model.state_dict()), "optimizer": osd, "train_state": {"s": 2}})


@pytest.mark.parametrize(
    ("field", "flatten"),
    [("master_param", False), ("master_param", True), ("fp32_param", False)],
    ids=["te-nested", "te-flattened", "megatron-name"],
)
def test_dcp_masters_round_trip_through_reshard(tmp_path, field, flatten):
    src, flat, re3, back = (tmp_path / n for n in ("src", "flat.safetensors", "re3", "back"))
    model, opt, _ = trained(2, field)
    save_masters_dcp(src, model, opt, flatten=flatten)
    assert run("convert", src, "-o", flat, "-n", "4").exit_code == 0
    result = run("reshard", flat, "-n", "3", "--sharded", "-o", re3)
    assert result.exit_code == 0, result.output
    result = run("restore", re3, "-o", back, "--format", "dcp")
    assert result.exit_code == 0, result.output
    want = dcp_tensors(src)
    assert any(k.endswith(field) for k in want)
    assert_same_tensors(dcp_tensors(back), want)


def test_master_buffers_share_their_weights_layout(tmp_path):
    src, flat = tmp_path / "src", tmp_path / "flat"
    model, opt, _ = trained(1)
    save_masters_dcp(src, model, opt)
    assert run("convert", src, "-o", flat, "-n", "2", "--sharded").exit_code == 0
    ckpt = open_flat(flat)
    assert ckpt.optim.masters == "master_param"
    stored = {b.name: b for b in ckpt.all_buffers}
    for b in ckpt.layout.buffers:
        master = stored.get(f"{b.name}@master_param")
        if b.dtype == "float32":  # float32 weights step themselves: no master buffer
            assert master is None
            continue
        assert (master.dtype, master.entries, master.padded_numel) == (
            "float32",
            b.entries,
            b.padded_numel,
        )
        for tensors in ckpt.files:
            assert tensors[master.name].shape == (b.padded_numel // 2,)
    assert ckpt.verify() == 2 * len(ckpt.files[0])  # every buffer checksummed on each rank
    # the masters are the optimizer's, each entry at its weight's offsets
    e = ckpt.layout.buffers[0].entries[0]
    from yafsdp_cli.checkpoint.flat_training import read_buffer

    got = read_buffer(ckpt, stored[f"{ckpt.layout.buffers[0].name}@master_param"])
    p = dict(model.named_parameters())[e.name]
    assert torch.equal(
        got[e.offset : e.offset + e.numel].view(e.shape), opt.state[p]["master_param"]
    )


def test_torch_save_masters_round_trip(tmp_path):
    src, flat, re1, back = (tmp_path / n for n in ("ckpt.pt", "flat", "re1.safetensors", "back.pt"))
    model, opt, _ = trained(2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 2}, src)
    result = run("convert", src, "--model", MODEL, "-o", flat, "-n", "2", "--sharded")
    assert result.exit_code == 0, result.output
    assert run("reshard", flat, "-n", "1", "-o", re1).exit_code == 0
    result = run("restore", re1, "-o", back)
    assert result.exit_code == 0, result.output
    got, want = torch.load(back, weights_only=True), opt.state_dict()
    assert got.keys() == {"model", "optimizer", "epoch"}
    assert_same_tensors(got["model"], model.state_dict())
    assert got["optimizer"]["param_groups"] == want["param_groups"]
    assert got["optimizer"]["state"].keys() == want["state"].keys()
    for pid, fields in want["state"].items():
        assert_same_tensors(got["optimizer"]["state"][pid], fields)


def _counted_by_group(osd: dict) -> dict:
    """``osd`` as Transformer Engine's ``FusedAdam`` keeps it: the step count in the
    param group (an int), none per parameter."""
    steps = [fields.pop("step") for fields in osd["state"].values()]
    for group in osd["param_groups"]:
        group["step"] = int(steps[0].item())
    return osd


@pytest.mark.parametrize("form", ["dcp", "torch-save"])
def test_a_step_counted_by_the_param_group_round_trips(tmp_path, form):
    src, flat, re3 = tmp_path / "src", tmp_path / "flat", tmp_path / "re3"
    model, opt, _ = trained(2)
    if form == "dcp":
        osd = _counted_by_group(get_optimizer_state_dict(model, opt))
        save_dcp(src, {"model": dict(model.state_dict()), "optimizer": osd})
        extra, back = (), tmp_path / "back"
    else:
        osd = _counted_by_group(opt.state_dict())
        src = tmp_path / "ckpt.pt"
        torch.save({"model": model.state_dict(), "optimizer": osd}, src)
        extra, back = ("--model", MODEL), tmp_path / "back.pt"
    result = run("convert", src, *extra, "-o", flat, "-n", "2", "--sharded")
    assert result.exit_code == 0, result.output
    assert run("reshard", flat, "-n", "3", "--sharded", "-o", re3).exit_code == 0
    fmt = ("--format", "dcp") if form == "dcp" else ()
    result = run("restore", re3, "-o", back, *fmt)
    assert result.exit_code == 0, result.output
    if form == "dcp":
        assert_same_tensors(dcp_tensors(back), dcp_tensors(src))
        return
    got = torch.load(back, weights_only=True)["optimizer"]
    assert got["param_groups"] == osd["param_groups"] and got["param_groups"][0]["step"] == 2
    for pid, fields in osd["state"].items():
        assert_same_tensors(got["state"][pid], fields)


def test_weights_only_drops_the_masters(tmp_path):
    src, flat = tmp_path / "src", tmp_path / "flat.safetensors"
    model, opt, _ = trained(1)
    save_masters_dcp(src, model, opt)
    assert run("convert", src, "-o", flat).exit_code == 0
    out = tmp_path / "w.safetensors"
    assert run("restore", flat, "-o", out, "--weights-only").exit_code == 0
    header, _ = read_header(out)
    assert not [k for k in header if "master" in k or "@" in k]
    assert run("convert", src, "-o", tmp_path / "w1.safetensors", "--weights-only").exit_code == 0
    assert open_flat(tmp_path / "w1.safetensors").optim is None


def _flat_llama(layout=None, seed=0):
    model = build("llama", seed=seed)
    layout = layout or plan(spec_from_module(model), LayoutOptions(world_size=4))
    return model, convert_module(model, layout)


def _assert_same_run(model, opt, flat, flat_opt) -> None:
    """The reference's weights, masters and moments equal the flat run's, bit for bit."""
    params = dict(model.named_parameters())
    for b in flat.buffers:
        master = flat_opt.stepped(b.param)
        state = flat_opt.state[master]
        for e in b.layout.entries:
            p, cut = params[e.name], slice(e.offset, e.offset + e.numel)
            assert torch.equal(b.param.detach()[cut].view(e.shape), p.detach()), e.name
            ref = opt.state[p]
            assert torch.equal(master[cut].view(e.shape), ref.get("master_param", p)), e.name
            for f in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[f][cut].view(e.shape), ref[f]), (e.name, f)


@pytest.mark.parametrize("form", ["dcp-nested", "dcp-flattened", "torch-save"])
def test_mixed_precision_resume_after_reshard_is_bit_exact(tmp_path, form):
    """bfloat16 weights, float32 masters, AdamW on the masters: 3 steps saved (a DCP
    folder or a torch.save dict), converted for 4 ranks, resharded to 3 and loaded by
    ``flat_adamw``; 3 more steps give the losses, weights, masters and moments of 6
    unbroken steps."""
    model, opt, unbroken = trained(6)
    first, first_opt, losses = trained(3)
    assert losses == unbroken[:3]
    src, flat, re3 = tmp_path / "src", tmp_path / "flat", tmp_path / "re3"
    if form == "torch-save":
        src = tmp_path / "ckpt.pt"
        torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, src)
    else:
        save_masters_dcp(src, first, first_opt, flatten=form == "dcp-flattened")
    assert run("convert", src, "--model", MODEL, "-o", flat, "-n", "4", "--sharded").exit_code == 0
    assert run("reshard", flat, "-n", "3", "--sharded", "-o", re3).exit_code == 0
    ckpt = open_flat(re3)
    fresh, fresh_flat = _flat_llama(ckpt.layout, seed=9)
    fresh_opt = flat_adamw(fresh_flat, ckpt, masters=True, lr=0.5)  # the checkpoint's lr wins
    assert isinstance(fresh_opt, MasterAdamW)
    assert train_steps(fresh, fresh_opt, 3, 3) == unbroken[3:]
    _assert_same_run(model, opt, fresh_flat, fresh_opt)
    # the library saves its masters too, and they come back as master_param
    save_flat_training(fresh_flat, fresh_opt, tmp_path / "again.safetensors")
    assert open_flat(tmp_path / "again.safetensors").optim.masters == "master_param"
    assert run("restore", tmp_path / "again.safetensors", "-o", tmp_path / "a.pt").exit_code == 0
    back = torch.load(tmp_path / "a.pt", weights_only=True)["optimizer"]["state"]
    name = "model.layers.0.mlp.up_proj.weight"
    master = opt.state[dict(model.named_parameters())[name]]["master_param"]
    assert torch.equal(back[name]["master_param"], master)


def test_flat_adamw_masters_train_like_per_parameter_masters(tmp_path):
    """A fresh ``flat_adamw(masters=True)``: float32 masters of the bfloat16 buffers
    only, stepping exactly as per-parameter masters do; saved and resumed bit-exactly."""
    model, opt, unbroken = trained(4)
    flat_model, flat = _flat_llama()
    flat_opt = flat_adamw(flat, masters=True, lr=LR)
    assert {b.layout.dtype for b in flat.buffers if flat_opt.stepped(b.param) is b.param} == {
        "float32"
    }
    assert train_steps(flat_model, flat_opt, 0, 2) == unbroken[:2]
    save_flat_training(flat, flat_opt, tmp_path / "run", sharded=True)
    fresh, fresh_flat = _flat_llama(open_flat(tmp_path / "run").layout, seed=5)
    fresh_opt = flat_adamw(fresh_flat, tmp_path / "run", masters=True)
    assert train_steps(fresh, fresh_opt, 2, 2) == unbroken[2:]
    _assert_same_run(model, opt, fresh_flat, fresh_opt)


def test_sharded_adamw_loads_its_slice_of_the_masters(tmp_path):
    from yafsdp_cli.checkpoint.flat_training import read_buffer
    from yafsdp_cli.checkpoint.sharded_training import sharded_adamw
    from yafsdp_cli.engine.sharded import LocalComm, ShardedFlat

    model, opt, _ = trained(1)
    save_masters_dcp(tmp_path / "src", model, opt)
    result = run(
        "convert", tmp_path / "src", "--model", MODEL, "-o", tmp_path / "f", "-n", "3", "--sharded"
    )
    assert result.exit_code == 0, result.output
    ckpt = open_flat(tmp_path / "f")
    stored = {b.name: b for b in ckpt.all_buffers}
    for rank in range(3):
        sharded = ShardedFlat(_flat_llama(ckpt.layout, seed=rank)[1], LocalComm(rank, 3))
        rank_opt = sharded_adamw(sharded, ckpt, masters=True)
        for b, shard in zip(sharded.flat.buffers, sharded.shards):
            s = b.layout.shard_numel
            master = rank_opt.stepped(shard)
            if b.layout.dtype == "float32":
                assert master is shard
                continue
            whole = read_buffer(ckpt, stored[f"{b.layout.name}@master_param"])
            assert torch.equal(master, whole[rank * s : (rank + 1) * s])
            assert torch.equal(shard.detach(), master.to(shard.dtype))  # rounded masters
        sharded.remove()


def test_flat_adamw_masters_must_match_the_checkpoint(tmp_path):
    model, opt, _ = trained(1)
    save_masters_dcp(tmp_path / "src", model, opt)
    result = run(
        "convert", tmp_path / "src", "--model", MODEL, "-o", tmp_path / "m.safetensors", "-n", "4"
    )
    assert result.exit_code == 0, result.output
    ckpt = open_flat(tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match="holds float32 master weights"):
        flat_adamw(_flat_llama(ckpt.layout)[1], ckpt)
    _, flat = _flat_llama()
    plain = flat_adamw(flat, lr=LR)
    train_steps(flat.module, plain, 0, 1)
    save_flat_training(flat, plain, tmp_path / "plain.safetensors")
    with pytest.raises(CheckpointError, match="holds no master weights"):
        flat_adamw(_flat_llama()[1], tmp_path / "plain.safetensors", masters=True)


# ---------------------------------------------------------------- refusals


def _edit_masters(path: Path, edit) -> None:
    model, opt, _ = trained(1)
    osd = get_optimizer_state_dict(model, opt)
    edit(osd["state"])
    save_dcp(path, {"model": dict(model.state_dict()), "optimizer": osd})


def _shape(state):
    state["lm_head.weight"]["master_param"] = torch.zeros(3)


def _narrow(state):
    state["lm_head.weight"]["master_param"] = state["lm_head.weight"]["master_param"].bfloat16()


def _remainders(state):  # Transformer Engine's int16 remainders, not a master
    m = state["lm_head.weight"]["master_param"]
    state["lm_head.weight"]["master_param"] = torch.zeros(m.shape, dtype=torch.int16)


def _ghost(state):
    state["ghost.weight"] = dict(state["lm_head.weight"])


def _some(state):
    del state["model.layers.1.mlp.up_proj.weight"]["master_param"]


def _one_buffer(state):  # layer 1's bfloat16 parameters, one flat buffer, without masters
    for name, fields in state.items():
        if name.startswith("model.layers.1.") and "master_param" in fields:
            del fields["master_param"]


def _two_names(state):
    fields = state["lm_head.weight"]
    fields["fp32_param"] = fields.pop("master_param")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_shape, "'lm_head.weight' has shape [3], but the parameter is [256, 64]"),
        (_narrow, "is bfloat16, but master weights are float32 or float64"),
        (_remainders, "is int16, but master weights are float32 or float64"),
        (_ghost, "of 'ghost.weight', which is no parameter"),
        (_some, "'model.layers.1.mlp.up_proj.weight' (bfloat16) has no master weight"),
        (_one_buffer, "(bfloat16) has no master weight 'master_param', but 'model.embed_tokens."),
        (_two_names, "master weights under two names, 'fp32_param' and 'master_param'"),
    ],
    ids=[
        "shape",
        "narrower",
        "int16-remainders",
        "not-in-model",
        "some-of-a-buffer",
        "a-buffer-without",
        "two-names",
    ],
)
def test_bad_masters_are_refused(tmp_path, edit, message):
    src, flat = tmp_path / "src", tmp_path / "flat.safetensors"
    _edit_masters(src, edit)
    result = run("convert", src, "-o", flat)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1
    assert not flat.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_a_master_weights_entry_beside_the_optimizer_is_refused(tmp_path):
    """No framework's convention says what ``{"master_weights": {name: tensor}}`` is."""
    src, flat = tmp_path / "ckpt.pt", tmp_path / "flat.safetensors"
    model = build("llama")
    plain = torch.optim.AdamW(model.parameters(), lr=LR)
    train_steps(model, plain, 0, 1)
    masters = {n: p.detach().float() for n, p in model.named_parameters()}
    state = {"model": model.state_dict(), "optimizer": plain.state_dict()}
    torch.save({**state, "master_weights": masters}, src)
    result = run("convert", src, "--model", MODEL, "-o", flat)
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "'master_weights.model.embed_tokens.weight' is a copy of parameter" in out
    assert len(result.output.strip().splitlines()) == 1 and not flat.exists()
    assert run("convert", src, "--model", MODEL, "-o", flat, "--weights-only").exit_code == 0
