"""DCP folders of the sample models, saved in one process by torch's own ``dcp.save``."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from helpers import build
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from yafsdp_cli.engine.inputs import make_input, projection_loss


def trained(name: str, optimizer: str = "adamw", steps: int = 1):
    """Sample model ``name`` after ``steps`` seeded optimizer steps, and its optimizer."""
    model = build(name)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        projection_loss(model(make_input(model, seed=step)), seed=step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save_dcp(path: Path, state: dict) -> Path:
    """``dcp.save`` without a process group (what one rank of a trainer writes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def training_checkpoint(path: Path, name: str, *, nested=True, optimizer="adamw") -> dict:
    """A torchtitan-style checkpoint of a trained sample model; returns its state dict."""
    model, opt = trained(name, optimizer)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt)
    state = {"model": weights} if nested else dict(weights)
    state.update(optimizer=osd, train_state={"step": 1}, lr_scheduler={"last": torch.ones(2)})
    save_dcp(path, state)
    return weights


def load_dcp_tensors(path: Path, like: dict) -> dict:
    """Every tensor of ``like``'s names, read back by torch's own loader."""
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out
