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

Mixed precision: with ``masters=True`` the optimizer is a ``MasterAdamW``, which steps
float32 master copies of the buffers narrower than float32 and rounds them into the
buffers after each step; the masters are saved and loaded as the state buffers
``B@master_param`` (``master_weights.py``), so a bfloat16 run resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine import dtypes
from ..engine.flat import FlatModel
from ..errors import CheckpointError
from .flat_writer import stored_kept, write_flat
from .master_weights import MASTER_STATES
from .optim_state import SEP, OptimState, decode, encode, path_of
from .reader import FlatCheckpoint, open_flat
from .restore.read_back import nest
from .writer import check_flat_name, check_output, staged_output

ADAM_STATES = ("exp_avg", "exp_avg_sq")
MASTER = MASTER_STATES[0]  # the field name masters are saved under


class MasterAdamW(torch.optim.AdamW):
    """AdamW over float32 master copies of low-precision weights (flat buffers or
    shards): ``step()`` gives each master its weight's gradient cast to float32, steps
    AdamW on the masters (and on the weights that have none), then copies each master
    into its weight, rounding to the weight's dtype. This is what Megatron-core's and
    Transformer Engine's optimizers do per parameter; elementwise, so over flat buffers
    it gives the same bits. ``state`` is keyed by the masters (``stepped``)."""

    def __init__(self, weights: list[torch.Tensor], masters: list[torch.Tensor | None], **hyper):
        self.pairs = [(w, m) for w, m in zip(weights, masters) if m is not None]
        self._master = {id(w): m for w, m in self.pairs}
        super().__init__([self.stepped(w) for w in weights], **hyper)

    def stepped(self, weight: torch.Tensor) -> torch.Tensor:
        """The tensor AdamW steps for ``weight``: its master, or itself."""
        return self._master.get(id(weight), weight)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for w, m in self.pairs:
            m.grad = None if w.grad is None else w.grad.to(m.dtype)
        super().step()
        for w, m in self.pairs:
            w.copy_(m)  # rounds to the weight's dtype
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for w, _ in self.pairs:  # the weights' gradients start the next step (engine)
            if set_to_none:
                w.grad = None
            elif w.grad is not None:
                w.grad.zero_()


def stepped(opt: torch.optim.Optimizer, weight: torch.Tensor) -> torch.Tensor:
    return opt.stepped(weight) if isinstance(opt, MasterAdamW) else weight


def flat_adamw(
    flat: FlatModel,
    ckpt: str | Path | FlatCheckpoint | None = None,
    *,
    masters: bool = False,
    **hyper,
):
    """AdamW over ``flat.flat_parameters()``; with ``ckpt`` (converted for this layout:
    ``convert_module(module, open_flat(path).layout)``), its weights and state loaded.
    ``masters``: a ``MasterAdamW`` that steps float32 masters of the buffers narrower
    than float32 (made from the weights, or loaded from ``ckpt``, which must hold them).
    ``hyper`` are AdamW's keywords; a checkpoint's own hyperparameters win."""
    refuse_kept(flat.kept_parameters())
    pairs = [(b.layout, b.param) for b in flat.buffers]
    if ckpt is None:
        return new_adamw(pairs, master_dtypes(pairs, None, masters), hyper)
    ckpt = opened(ckpt)
    adamw_extras(ckpt)  # no AdamW state: say so before reading anything
    opt = new_adamw(pairs, master_dtypes(pairs, ckpt, masters), hyper)
    ckpt.verify()
    load_adamw(opt, ckpt, pairs, lambda stored: read_buffer(ckpt, stored))
    load_kept(flat.module, ckpt)
    return opt


def new_adamw(pairs, masters: dict[str, str], hyper: dict) -> torch.optim.AdamW:
    """AdamW over the tensors of ``pairs`` (``(BufferLayout, tensor)``); with
    ``masters`` (buffer name -> dtype) a ``MasterAdamW``, masters copied from the weights."""
    weights = [w for _, w in pairs]
    if not masters:
        return torch.optim.AdamW(weights, **hyper)
    copies = [
        w.detach().to(dtypes.to_torch(masters[b.name]), copy=True) if b.name in masters else None
        for b, w in pairs
    ]
    return MasterAdamW(weights, copies, **hyper)


def master_dtypes(pairs, ckpt: FlatCheckpoint | None, masters: bool) -> dict[str, str]:
    """Buffer name -> master dtype: fresh, float32 for each buffer narrower than it;
    from ``ckpt``, what it holds, which must agree with ``masters``."""
    if ckpt is None:
        narrow = [b.name for b, _ in pairs if dtypes.itemsize(b.dtype) < 4]
        return dict.fromkeys(narrow, "float32") if masters else {}
    field = ckpt.optim.masters
    if masters and field is None:
        raise CheckpointError(
            f"{ckpt.root} holds no master weights; resuming with masters=True would start "
            "them from the rounded weights: pass masters=False"
        )
    if field is not None and not masters:
        raise CheckpointError(
            f"{ckpt.root} holds float32 master weights ({field!r}); pass masters=True to "
            "step them, or the run would lose them"
        )
    return dict(ckpt.optim.dtypes[field]) if field else {}


def opened(ckpt: str | Path | FlatCheckpoint) -> FlatCheckpoint:
    return ckpt if isinstance(ckpt, FlatCheckpoint) else open_flat(ckpt)


def load_adamw(opt, ckpt: FlatCheckpoint, pairs, read) -> None:
    """Fill ``opt`` (AdamW over the parameters of ``pairs``: ``(BufferLayout,
    tensor)``, a whole buffer or a rank's shard) from ``ckpt``: ``read(stored)``
    gives that tensor's part of a stored buffer (weights, then each state buffer)."""
    extras = adamw_extras(ckpt)
    stored = {b.name: b for b in ckpt.all_buffers}
    field = ckpt.optim.masters
    for layout, param in pairs:
        if layout != stored.get(layout.name):
            raise CheckpointError(
                f"{layout.name}: the module was converted with another layout than the "
                f"checkpoint's; convert it with open_flat(...).layout"
            )
        master = stepped(opt, param)
        with torch.no_grad():
            param.copy_(read(stored[layout.name]))
            if master is not param:
                master.copy_(read(stored[f"{layout.name}{SEP}{field}"]))
        state = {"step": _step(ckpt.optim, extras, layout)}
        for f in ADAM_STATES:
            state[f] = read(stored[f"{layout.name}{SEP}{f}"])
        opt.state[master] = state
    opt.param_groups[0].update(_hyperparameters(ckpt.optim, extras))


def _step(optim: OptimState, extras: dict, layout) -> torch.Tensor:
    """A buffer's step count: beside the ``exp_avg`` of its first entry with state
    (``optimizer.state.NAME.step``, or ``state.NAME.step`` in DCP's flattened form)."""
    path = next(
        (optim.paths[e.name]["exp_avg"] for e in layout.entries if e.name in optim.paths), None
    )
    if path is None:
        raise CheckpointError(f"{layout.name}: the checkpoint holds no AdamW state for it")
    *head, last = path_of(path)
    step = extras.get((*head, last[: -len("exp_avg")] + "step" if _flattened(path) else "step"))
    if step is None:
        raise CheckpointError(f"{layout.name}: the checkpoint holds no AdamW step count for it")
    return step.clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))


def _flattened(path: list) -> bool:
    """A state path of ``StateDictOptions(flatten_optimizer_state_dict=True)``."""
    return len(path) == 2 and isinstance(path[1], str) and path[1].startswith("state.")


def _hyperparameters(optim: OptimState, extras: dict) -> dict:
    """The hyperparameters of the source's param groups, which must agree: one AdamW
    group steps every flat buffer."""
    path = next(iter(next(iter(optim.paths.values())).values()))  # any state tensor's
    root = tuple(path_of(path))[: -1 if _flattened(path) else -3]  # the optimizer's key path
    groups = _flattened_groups(extras, root) if _flattened(path) else _groups(extras, root)
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    if not hypers or any(h != hypers[0] for h in hypers):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(hypers)} param groups of different "
            "hyperparameters; one AdamW group steps every flat buffer"
        )
    return hypers[0]


def _groups(extras: dict, root: tuple) -> list[dict]:
    """``ROOT.param_groups``: a list of dicts, whole (``torch.save``) or item by item
    (``dcp.save``)."""
    n = len(root)
    inside = {p[n:]: v for p, v in extras.items() if p[: n + 1] == (*root, "param_groups")}
    return nest(inside)["param_groups"] if inside else []


def _flattened_groups(extras: dict, root: tuple) -> list[dict]:
    """``ROOT.param_groups.NAME.KEY`` (``flatten_optimizer_state_dict``): each
    parameter's group, as a dict."""
    by_param: dict[str, dict] = {}
    for p, v in extras.items():
        if p[:-1] == root and str(p[-1]).startswith("param_groups."):
            name, _, key = p[-1][len("param_groups.") :].rpartition(".")
            by_param.setdefault(name, {})[key] = v
    return list(by_param.values())


def adamw_extras(ckpt: FlatCheckpoint) -> dict:
    optim = ckpt.optim
    states = set(optim.dtypes) - {optim.masters} if optim is not None else set()
    if optim is None or optim.kind != "adam" or states != set(ADAM_STATES):
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
    isz = dtypes.itemsize(b.dtype)
    stop = b.padded_numel if stop is None else stop
    chunks = ckpt.read_range(b, start * isz, stop * isz)
    return _tensor(chunks, (stop - start) * isz, b.dtype)


def read_kept(ckpt: FlatCheckpoint, t) -> torch.Tensor:
    return _tensor(ckpt.kept_bytes(t.name), ckpt.files[0][t.name].nbytes, t.dtype)


def _tensor(chunks, nbytes: int, dtype: str) -> torch.Tensor:
    data = bytearray(nbytes)
    pos = 0
    for chunk in chunks:
        data[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return torch.frombuffer(data, dtype=dtypes.to_torch(dtype))


def adamw_record(pairs, opt: torch.optim.Optimizer) -> OptimState:
    """The optimizer record of ``opt``'s AdamW state for ``pairs`` (``(BufferLayout,
    tensor)``: each buffer, with the weight tensor the optimizer steps on for it)."""
    extras, paths, found = [], {}, {}
    for layout, param in pairs:
        master = stepped(opt, param)
        state = opt.state.get(master)
        if not state or set(state) != {"step", *ADAM_STATES}:
            raise CheckpointError(
                f"{layout.name}: the optimizer keeps {sorted(state or {})}, not AdamW's "
                "step, exp_avg and exp_avg_sq; save after the optimizer's first step"
            )
        fields = (*ADAM_STATES, MASTER) if master is not param else ADAM_STATES
        for f in fields:
            t = master if f == MASTER else state[f]
            found.setdefault(f, {})[layout.name] = dtypes.from_torch(t.dtype)
        for e in layout.entries:
            paths[e.name] = {f: ["optimizer", "state", e.name, f] for f in fields}
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
    """Each buffer's tensor and its AdamW state (and master), by stored name (``B``,
    ``B@FIELD``)."""
    out = {}
    for layout, param in pairs:
        master = stepped(opt, param)
        out[layout.name] = param.detach()
        for f in ADAM_STATES:
            out[f"{layout.name}{SEP}{f}"] = opt.state[master][f]
        if master is not param:
            out[f"{layout.name}{SEP}{MASTER}"] = master
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
