"""Training on flat buffers from, and to, a flat checkpoint with optimizer state.

``flat_adamw(flat, ckpt)`` is ``torch.optim.AdamW`` over a ``FlatModel``'s flat
buffers (the metaparam way: one state tensor per buffer), its weights and state
loaded from ``ckpt``'s buffers and state buffers: a state buffer ``B@exp_avg`` is
exactly the ``exp_avg`` AdamW keeps for flat parameter ``B``, padding included (zero
gradient, zero state). ``save_flat_training(flat, opt, out)`` writes the same
checkpoint back (format version 2), so ``reshard`` carries a run to another world
size. The record's form is ``pt``: ``restore`` gives a ``torch.save`` dict
``{"model": state dict, "optimizer": {"state": {name: {...}}, "param_groups"}}``,
the per-parameter state (each entry's slice of its buffer's state) keyed by name.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.flat import FlatModel
from ..errors import CheckpointError
from .flat_writer import write_flat
from .optim_state import SEP, OptimState, decode, encode, path_of
from .reader import FlatCheckpoint, open_flat
from .writer import check_flat_name, check_output, staged_output

FIELDS = ("exp_avg", "exp_avg_sq")


def flat_adamw(flat: FlatModel, ckpt: str | Path | FlatCheckpoint | None = None, **hyper):
    """AdamW over ``flat.flat_parameters()``; with ``ckpt`` (converted for this layout:
    ``convert_module(module, open_flat(path).layout)``), its weights and state loaded.
    ``hyper`` are AdamW's keywords; a checkpoint's own hyperparameters win."""
    _refuse_kept(flat)
    opt = torch.optim.AdamW(list(flat.flat_parameters()), **hyper)
    if ckpt is None:
        return opt
    ckpt = ckpt if isinstance(ckpt, FlatCheckpoint) else open_flat(ckpt)
    ckpt.verify()
    optim = ckpt.optim
    if optim is None or optim.kind != "adam" or set(optim.dtypes) != set(FIELDS):
        raise CheckpointError(
            f"{ckpt.root}: holds no AdamW state ({optim.kind if optim else 'weights only'})"
        )
    stored = {b.name: b for b in ckpt.all_buffers}
    extras = {path_of(p): decode(v) for p, v in optim.extras}
    for b in flat.buffers:
        if b.layout != stored.get(b.layout.name):
            raise CheckpointError(
                f"{b.layout.name}: the module was converted with another layout than the "
                f"checkpoint's; convert it with open_flat(...).layout"
            )
        with torch.no_grad():
            b.param.copy_(_read(ckpt, stored[b.layout.name]))
        first = b.layout.entries[0].name
        state = {"step": extras[("optimizer", "state", first, "step")].clone()}
        for field in FIELDS:
            state[field] = _read(ckpt, stored[f"{b.layout.name}{SEP}{field}"])
        opt.state[b.param] = state
    group = extras[("optimizer", "param_groups")][0]
    opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
    return opt


def _refuse_kept(flat: FlatModel) -> None:
    trained = [n for n, p in flat.kept_parameters() if p.requires_grad]
    if trained:
        raise CheckpointError(
            f"{trained[0]!r} is trained but not in a flat buffer; convert every trained "
            "parameter (widen --filter) to train on flat buffers alone"
        )


def _read(ckpt: FlatCheckpoint, b) -> torch.Tensor:
    """Logical buffer ``b`` of ``ckpt`` (across rank files), as a new tensor."""
    from ..engine import dtypes

    data = bytearray(b.nbytes)
    pos = 0
    for chunk in ckpt.read_range(b, 0, b.nbytes):
        data[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return torch.frombuffer(data, dtype=dtypes.to_torch(b.dtype))


def _record(flat: FlatModel, opt: torch.optim.Optimizer) -> OptimState:
    from ..engine import dtypes

    extras, paths, found = [], {}, {}
    for b in flat.buffers:
        state = opt.state.get(b.param)
        if not state or set(state) != {"step", *FIELDS}:
            raise CheckpointError(
                f"{b.layout.name}: the optimizer keeps {sorted(state or {})}, not AdamW's "
                "step, exp_avg and exp_avg_sq; save after the first step of flat_adamw"
            )
        for f in FIELDS:
            found.setdefault(f, {})[b.layout.name] = dtypes.from_torch(state[f].dtype)
        for e in b.layout.entries:
            paths[e.name] = {f: ["optimizer", "state", e.name, f] for f in FIELDS}
            extras.append([["optimizer", "state", e.name, "step"], encode(state["step"])])
    names = [e.name for b in flat.buffers for e in b.layout.entries]
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    extras.append([["optimizer", "param_groups"], encode([{**group, "params": names}])])
    return OptimState("adam", "pt", ("model",), found, paths, extras)


def save_flat_training(
    flat: FlatModel, opt: torch.optim.Optimizer, out: str | Path, *, sharded: bool = False
) -> None:
    """Write ``flat``'s weights and ``opt``'s AdamW state (``flat_adamw``) as a flat
    checkpoint for ``flat.layout`` (one file, or a folder of rank files)."""
    out = Path(out)
    check_flat_name(out, sharded=sharded)
    check_output(out, inputs=[], force=False, folder=sharded)
    optim = _record(flat, opt)
    tensors = {b.layout.name: b.param.detach() for b in flat.buffers}
    for b in flat.buffers:
        for f in FIELDS:
            tensors[f"{b.layout.name}{SEP}{f}"] = opt.state[b.param][f]
    state = flat.module.state_dict()
    with staged_output(out, folder=sharded) as staged:
        write_flat(
            staged.temp,
            flat.layout,
            sharded=sharded,
            buffer_bytes=lambda b: [_bytes(tensors[b.name])],
            kept_bytes=lambda t: [_bytes(state[t.name])],
            source="flat_adamw",
            final=out,
            optim=optim,
        )


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
