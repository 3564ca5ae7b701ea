"""Checkpoint folders with a symbolic link out of them, and Trainer folders whose parts
cannot be read: each builder writes into a folder and returns the path to give.

A file outside the checkpoint holds ``SECRET``; a reader that follows the link would
carry it into the output (a Trainer folder's carried files, a safetensors header's
metadata) or echo it. ``LINKS`` are corpus cases (every command that reads the
source); the Trainer builders serve ``test_links.py``, which needs transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from pathlib import Path

from .common import Case
from .flat_cases import FLAT_COMMANDS, R1, make_flat
from .st_cases import GOOD_DATA, SOURCE_COMMANDS, good_header, st_bytes

SECRET = "SECRET-7f3a9c-do-not-carry"
OUTSIDE = "outside"  # beside the checkpoint folder, in the case's folder


def outside(folder: Path) -> Path:
    """The folder beside the checkpoint that its links lead into."""
    out = folder / OUTSIDE
    out.mkdir(exist_ok=True)
    return out


def secret_file(folder: Path, name: str = "secret.txt") -> Path:
    path = outside(folder) / name
    path.write_text(f"token={SECRET}\n")
    return path


def secret_safetensors(path: Path) -> Path:
    """A valid safetensors file whose metadata holds ``SECRET`` (carried into a flat
    checkpoint's source metadata if it were read)."""
    header = {**good_header(), "__metadata__": {"note": SECRET}}
    path.write_bytes(st_bytes(header, GOOD_DATA))
    return path


def link(path: Path, target: Path | str) -> None:
    path.symlink_to(target)


# ------------------------------------------------------------ corpus cases


def _weights_link_out(folder: Path) -> Path:
    ckpt = folder / "model"
    ckpt.mkdir()
    link(ckpt / "model.safetensors", secret_safetensors(outside(folder) / "w.safetensors"))
    return ckpt


def _index_link_out(folder: Path) -> Path:
    """The index itself links out; its shard lies in the folder."""
    ckpt = folder / "model"
    ckpt.mkdir()
    secret_safetensors(ckpt / "s1.safetensors")
    index = outside(folder) / "m.safetensors.index.json"
    weight_map = {"a.weight": "s1.safetensors", "b.bias": "s1.safetensors"}
    index.write_text(json.dumps({"metadata": {"note": SECRET}, "weight_map": weight_map}))
    link(ckpt / "m.safetensors.index.json", index)
    return ckpt


def _pt_shard_link_out(folder: Path) -> Path:
    import torch

    ckpt = folder / "model"
    ckpt.mkdir()
    torch.save({"a.weight": torch.zeros(2, 3)}, outside(folder) / "s1.bin")
    link(ckpt / "s1.bin", folder / OUTSIDE / "s1.bin")
    weight_map = {"a.weight": "s1.bin"}
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt / "pytorch_model.bin.index.json"


def _config_link_out(folder: Path) -> Path:
    ckpt = folder / "model"
    ckpt.mkdir()
    secret_safetensors(ckpt / "model.safetensors")
    config = outside(folder) / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "note": SECRET}))
    link(ckpt / "config.json", config)
    return ckpt


def _adapter_link_out(folder: Path) -> Path:
    ckpt = folder / "adapter"
    ckpt.mkdir()
    config = outside(folder) / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": SECRET}))
    link(ckpt / "adapter_config.json", config)
    return ckpt


def _flat_rank_link_out(folder: Path) -> Path:
    """Rank 1's file moved out of the set and linked back in: a valid rank file, so
    only the link rule refuses it."""
    path = make_flat(folder, sharded=True)
    moved = outside(folder) / R1
    shutil.move(path / R1, moved)
    link(path / R1, moved)
    return path


def _flat_index_link_out(folder: Path) -> Path:
    from yafsdp_cli.checkpoint.format import INDEX_NAME

    path = make_flat(folder, sharded=True)
    moved = outside(folder) / INDEX_NAME
    shutil.move(path / INDEX_NAME, moved)
    link(path / INDEX_NAME, moved)
    return path


LINK_OUT = "is a symbolic link out of the folder .*never followed"
LINKS = [
    Case("folder-weights-link-out", _weights_link_out, "model.safetensors " + LINK_OUT),
    Case("folder-index-link-out", _index_link_out, "m.safetensors.index.json " + LINK_OUT),
    Case("pt-index-shard-link-out", _pt_shard_link_out, "'s1.bin', a link to .*outside its"),
    Case("hf-config-link-out", _config_link_out, "config.json " + LINK_OUT),
    Case("adapter-config-link-out", _adapter_link_out, "adapter_config.json " + LINK_OUT),
]
for _c in LINKS:
    _c.commands = SOURCE_COMMANDS
_FLAT_LINKS = [
    Case("flat-rank-link-out", _flat_rank_link_out, f"{R1} " + LINK_OUT),
    Case("flat-index-link-out", _flat_index_link_out, "yafsdp.index.json " + LINK_OUT),
]
for _c in _FLAT_LINKS:
    _c.commands = FLAT_COMMANDS
LINKS += _FLAT_LINKS


# ------------------------------------------------------------ Trainer folders


def trainer_folder(path: Path) -> Path:
    """A small Hugging Face Trainer checkpoint (``checkpoint-N/``) as the Trainer
    writes one, without training: a tiny Llama's ``save_pretrained`` files, an AdamW
    over ``Trainer.create_optimizer``'s two weight-decay groups after one step, and a
    few of the loop's small files."""
    import torch
    import transformers as tf
    from dcp_helpers import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    path.mkdir(parents=True)
    model.save_pretrained(path)
    decay = set(tf.Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    for _, p in named:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    torch.save(opt.state_dict(), path / "optimizer.pt")
    torch.save({"last_epoch": 1}, path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return path


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def _device(path: Path) -> None:
    """``/dev/null``'s device node made in the folder (a link to it would be refused
    as a link out, so the node itself); needs the right to make one."""
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))


def _dangling(path: Path) -> None:
    path.symlink_to("optimizer.pt.gone")


def _loop(path: Path) -> None:
    path.symlink_to(path.name)


def _no_read(path: Path) -> None:
    path.write_bytes(b"\x80\x02}q\x00.")
    path.chmod(0)


# optimizer.pt replaced by something that is no readable file -> the words the error
# gives for it
BAD_OPTIMIZERS = {
    "fifo": (_fifo, "not a regular file (a FIFO, socket or device)"),
    "socket": (_socket, "not a regular file (a FIFO, socket or device)"),
    "device": (_device, "not a regular file (a FIFO, socket or device)"),
    "folder": (Path.mkdir, "not a regular file (a folder)"),
    "dangling-link": (_dangling, "cannot read (No such file or directory)"),
    "looping-link": (_loop, "cannot read (Too many levels of symbolic links)"),
    "unreadable": (_no_read, "cannot read (Permission denied)"),
}
