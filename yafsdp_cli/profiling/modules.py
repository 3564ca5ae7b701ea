"""Which module made what: module names for the tracker, and the peak by module.

``--modules N`` ranks the makers of the activations alive at the step's peak. A
block is credited to the innermost module whose forward made it (the ``q_proj`` that
produced a projection, the ``self_attn`` that ran the attention kernel), so rows do
not count a byte twice; modules whose names differ only in their indices
(``model.layers.0.mlp`` ... ``model.layers.79.mlp``) are one row, with their count,
as a model's repeated blocks make the same activations.
"""

from __future__ import annotations

import contextlib
import re
import warnings

import torch
from torch import nn

from .profile_report import ModuleShare

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def module_names(module: nn.Module, opts) -> dict[int, str]:
    """``id(module) -> name`` for the modules the tracker follows: every named module
    when the peak is broken down by module, else those the per-module rows need."""
    if not (opts.modules or opts.per_module):
        return {}
    out: dict[int, str] = {}
    for name, m in module.named_modules():
        if name and (opts.modules or name.count(".") < opts.depth):
            out.setdefault(id(m), name)
    return out


def pattern(name: str) -> str:
    """``model.layers.12.mlp`` -> ``model.layers.*.mlp``."""
    return _INDEX.sub("*", name)


def peak_shares(module: nn.Module, made: dict[str, int], top: int) -> tuple[ModuleShare, ...]:
    """The ``top`` largest rows of ``made`` (bytes by module name), grouped by pattern."""
    if not top or not made:
        return ()
    kinds = {name: type(m).__name__ for name, m in module.named_modules()}
    groups: dict[str, list] = {}
    for name, nbytes in made.items():
        row = groups.setdefault(pattern(name), [kinds.get(name, "?"), 0, 0])
        row[1] += 1
        row[2] += nbytes
    rows = [ModuleShare(p, kind, count, b) for p, (kind, count, b) in groups.items()]
    rows.sort(key=lambda r: (-r.bytes, r.name))
    return tuple(rows[:top])


@contextlib.contextmanager
def tracking_modules(tracker, names: dict[int, str]):
    """Tell ``tracker`` when each named module's forward and backward start and end."""
    if not names:
        yield
        return
    from torch.distributed._tools.mod_tracker import ModTracker

    def hook(backward: bool, enter: bool):
        def fn(mod, *_args):
            name = names.get(id(mod)) if mod is not None else None
            if name is not None:
                (tracker.enter_module if enter else tracker.exit_module)(name, backward)

        return fn

    mt = ModTracker()
    mt.register_user_hooks(
        hook(False, True), hook(False, False), hook(True, True), hook(True, False)
    )
    with removing_grad_hooks(), quiet_tracker(), mt:
        yield
    mt.clear_user_hooks()


# ModTracker's warning when a module's forward starts while the module is still on its
# stack of parents, which transformers models do on every step; the figures here come
# from ``names``, not from that stack, so it says nothing about the user's model
TRACKER_WARNING = r"The module hierarchy tracking maybe be messed up"


@contextlib.contextmanager
def quiet_tracker():
    """Silence ModTracker's hierarchy warning, and only it, while the step runs; and
    put back the ``warnings.formatwarning`` it replaces process-wide before warning."""
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRACKER_WARNING, category=UserWarning)
        try:
            yield
        finally:
            warnings.formatwarning = formatwarning


@contextlib.contextmanager
def removing_grad_hooks():
    """Remove, once the step is over, the multi-grad hooks ``ModTracker`` puts on each
    module's inputs and outputs.

    Each such hook keeps the graph nodes it watches in its closure and lives on those
    nodes in autograd's C++ side, where the garbage collector cannot see it: a cycle
    that keeps the step's graph, and through it the model's parameters, alive after
    the profile returns (``tests/profiling/test_profile_reserved.py`` counts what outlives a
    call). ``ModTracker`` keeps no handles, so its call is wrapped to keep them."""
    from torch.distributed._tools import mod_tracker

    original = mod_tracker.register_multi_grad_hook
    handles = []

    def register(*args, **kwargs):
        handle = original(*args, **kwargs)
        handles.append(handle)
        return handle

    mod_tracker.register_multi_grad_hook = register
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = original
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def tracking_layers(tracker, layers: dict, first: bool = False):
    """Tell ``tracker`` when each layer of a stack (``{index: (name, module)}``) runs:
    its forward by module hooks; its backward from when its output's gradient is
    ready to when its input's is, by hooks on those two tensors. Unlike
    ``ModTracker`` these hold no tensor and no graph node, so the step keeps what a
    step without them keeps (a reentrant checkpoint's outputs outlive the step
    under ``ModTracker``). ``first``: the forward's end is told before the layer's
    other hooks run, so its backward begins before theirs (an engine's hook on the
    same output, FSDP2's gather of the layer below, runs inside the layer's
    backward)."""
    handles = []

    def first_grad_tensor(values):
        for v in values:
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return v
        return None

    def pre(name):
        def fn(_mod, args, kwargs):
            tracker.enter_module(name, False)
            if tracker.phase == "forward":
                t = first_grad_tensor((*args, *kwargs.values()))
                if t is not None:
                    t.register_hook(lambda _g: tracker.exit_module(name, True))

        return fn

    def post(name):
        def fn(_mod, _args, _kwargs, output):
            tracker.exit_module(name, False)
            if tracker.phase == "forward":
                outs = output if isinstance(output, (tuple, list)) else (output,)
                t = first_grad_tensor(outs)
                if t is not None:
                    t.register_hook(lambda _g: tracker.enter_module(name, True))

        return fn

    for name, layer in layers.values():
        handles.append(layer.register_forward_pre_hook(pre(name), with_kwargs=True, prepend=True))
        handles.append(layer.register_forward_hook(post(name), with_kwargs=True, prepend=first))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
