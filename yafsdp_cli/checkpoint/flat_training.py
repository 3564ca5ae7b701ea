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
from .flat_writer import stored_kept, write_flat
from .optim_state import SEP, OptimState, decode, encode, path_of
from .reader import FlatCheckpoint, open_flat
from .writer import check_flat_name, check_output, staged_output

FIELDS = ("exp_avg", "exp_avg_sq")


def flat_adamw(flat: FlatModel, ckpt: str | Path | FlatCheckpoint | None = None, **hyper):
    """AdamW over ``flat.flat_parameters()``; with ``ckpt`` (converted for this layout:
    ``convert_module(module, open_flat(path).layout)``), its weights and state loaded.
    ``hyper`` are AdamW's keywords; a checkpoint's own hyperparameters win."""
    refuse_kept(flat.kept_parameters())
    opt = torch.optim.AdamW(list(flat.flat_parameters()), **hyper)
    if ckpt is None:
        return opt
    ckpt = opened(ckpt)
    ckpt.verify()
    pairs = [(b.layout, b.param) for b in flat.buffers]
    load_adamw(opt, ckpt, pairs, lambda stored: read_buffer(ckpt, stored))
    load_kept(flat.module, ckpt)
    return opt


def opened(ckpt: str | Path | FlatCheckpoint) -> FlatCheckpoint:
    return ckpt if isinstance(ckpt, FlatCheckpoint) else open_flat(ckpt)


def load_adamw(opt, ckpt: FlatCheckpoint, pairs, read) -> None:
    """Fill ``opt`` (AdamW over the parameters of ``pairs``: ``(BufferLayout,
    tensor)``, a whole buffer or a rank's shard) from ``ckpt``: ``read(stored)``
    gives that tensor's part of a stored buffer (weights, then each state buffer)."""
    extras = adamw_extras(ckpt)
    stored = {b.name: b for b in ckpt.all_buffers}
    for layout, param in pairs:
        if layout != stored.get(layout.name):
            raise CheckpointError(
                f"{layout.name}: the module was converted with another layout than the "
                f"checkpoint's; convert it with open_flat(...).layout"
            )
        with torch.no_grad():
            param.copy_(read(stored[layout.name]))
        first = layout.entries[0].name
        state = {"step": extras[("optimizer", "state", first, "step")].clone()}
        for field in FIELDS:
            state[field] = read(stored[f"{layout.name}{SEP}{field}"])
        opt.state[param] = state
    group = extras[("optimizer", "param_groups")][0]
    opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})


def adamw_extras(ckpt: FlatCheckpoint) -> dict:
    optim = ckpt.optim
    if optim is None or optim.kind != "adam" or set(optim.dtypes) != set(FIELDS):
        raise CheckpointError(
            f"{ckpt.root}: holds no AdamW state ({optim.kind if optim else 'weights only'})"
        )
    return {path_of(p): decode(v) for p, v in optim.extras}


def load_kept(module: torch.nn.Module, ckpt: FlatCheckpoint) -> None:
    """The stored tensors outside the flat buffers (frozen parameters, persistent
    module buffers) into ``module``, by state-dict name."""
    state = module.state_dict()
    for t in stored_kept(ckpt.layout):
        with torch.no_grad():
            state[t.name].copy_(read_kept(ckpt, t).view(t.shape))


def refuse_kept(kept) -> None:
    """AdamW here steps on flat buffers alone: no trained ``(name, parameter)`` outside."""
    trained = [n for n, p in kept if p.requires_grad]
    if trained:
        raise CheckpointError(
            f"{trained[0]!r} is trained but not in a flat buffer; convert every trained "
            "parameter (widen --filter) to train on flat buffers alone"
        )


def read_buffer(ckpt: FlatCheckpoint, b, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Elements ``[start, stop)`` of logical buffer ``b`` of ``ckpt`` (across rank
    files; all of it by default), as a new tensor."""
    from ..engine import dtypes

    isz = dtypes.itemsize(b.dtype)
    stop = b.padded_numel if stop is None else stop
    chunks = ckpt.read_range(b, start * isz, stop * isz)
    return _tensor(chunks, (stop - start) * isz, b.dtype)


def read_kept(ckpt: FlatCheckpoint, t) -> torch.Tensor:
    return _tensor(ckpt.kept_bytes(t.name), ckpt.files[0][t.name].nbytes, t.dtype)


def _tensor(chunks, nbytes: int, dtype: str) -> torch.Tensor:
    from ..engine import dtypes

    data = bytearray(nbytes)
    pos = 0
    for chunk in chunks:
        data[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return torch.frombuffer(data, dtype=dtypes.to_torch(dtype))


def adamw_record(pairs, opt: torch.optim.Optimizer) -> OptimState:
    """The optimizer record of ``opt``'s AdamW state for ``pairs`` (``(BufferLayout,
    tensor)``: each buffer, with the tensor the optimizer steps on for it)."""
    from ..engine import dtypes

    extras, paths, found = [], {}, {}
    for layout, param in pairs:
        state = opt.state.get(param)
        if not state or set(state) != {"step", *FIELDS}:
            raise CheckpointError(
                f"{layout.name}: the optimizer keeps {sorted(state or {})}, not AdamW's "
                "step, exp_avg and exp_avg_sq; save after the optimizer's first step"
            )
        for f in FIELDS:
            found.setdefault(f, {})[layout.name] = dtypes.from_torch(state[f].dtype)
        for e in layout.entries:
            paths[e.name] = {f: ["optimizer", "state", e.name, f] for f in FIELDS}
            extras.append([["optimizer", "state", e.name, "step"], encode(state["step"])])
    names = [e.name for layout, _ in pairs for e in layout.entries]
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
    pairs = [(b.layout, b.param) for b in flat.buffers]
    optim = adamw_record(pairs, opt)
    tensors = training_tensors(pairs, opt)
    state = flat.module.state_dict()
    with staged_output(out, folder=sharded) as staged:
        write_flat(
            staged.temp,
            flat.layout,
            sharded=sharded,
            buffer_bytes=lambda b: [tensor_bytes(tensors[b.name])],
            kept_bytes=lambda t: [tensor_bytes(state[t.name])],
            source="flat_adamw",
            final=out,
            optim=optim,
        )


def training_tensors(pairs, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each buffer's tensor and its AdamW state, by stored name (``B``, ``B@FIELD``)."""
    out = {}
    for layout, param in pairs:
        out[layout.name] = param.detach()
        for f in FIELDS:
            out[f"{layout.name}{SEP}{f}"] = opt.state[param][f]
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
