"""A model's stack of repeated layers, its period, and the model cut to fewer of them.

A transformer's blocks repeat, but not always one by one: Gemma alternates sliding
and full attention, Qwen3-MoE has a dense MLP every ``decoder_sparse_step`` layers
or in ``mlp_only_layers``, DeepSeek-V3 starts with ``first_k_dense_replace`` dense
layers. ``find_stack`` describes each layer of the largest ``ModuleList`` by what
could make its step differ (every submodule's class, its parameters' and buffers'
shapes and dtypes, its plain settings such as ``sliding_window``, an attention
type or a dropout rate; not its own index) and finds the shortest ``period`` after
a ``prefix`` of layers that differ. The description cannot see everything a
forward may read (a branch on ``config.layer_types[self.layer_idx]``); that is
why the periodic step is always checked against a traced one (``periodic``).

Checkpointing every N-th block (``selective:layer=N``) makes layers that are alike
step differently: ``find_stack(module, every=N)`` gives the period as the least
common multiple of the layers' own and N. That holds where the blocks counted are
the stack's layers, one each (transformers' decoder layers, the default units):
then a period holds a multiple of N blocks, wherever the count starts, and each
layer is checkpointed as the layer one period on. Where the blocks are counted
otherwise (several to a layer), the check against the trace one period deeper
(``periodic``) finds the difference and the whole model is traced.

``cut(module, stack, depth)`` gives the module with the first ``depth`` layers of
its stack only, the rest of it shared: a prefix of the model, as a config of fewer
layers would build it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.choices import nth

# attributes that name a layer's place, not what it does
INDEX_ATTRS = frozenset(
    {"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index"}
)
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True, slots=True)
class Stack:
    """The repeated layers at ``path`` (``model.layers``): ``depth`` of them, the first
    ``prefix`` unlike the rest, then a pattern of ``period`` layers."""

    path: str
    depth: int
    prefix: int
    period: int
    every: int = 1  # every N-th block checkpointed: part of the period (see above)

    @property
    def tail(self) -> int:
        """Layers after the last whole period."""
        return (self.depth - self.prefix) % self.period

    @property
    def traced(self) -> int:
        """The depth traced: the prefix, three periods, the tail. The middle period is
        the one repeated: the period before it and after it are like its neighbours
        in the whole model."""
        return self.prefix + 3 * self.period + self.tail

    @property
    def checked(self) -> int:
        """The depth traced to check the repetition against: one period more."""
        return self.traced + self.period

    @property
    def worth(self) -> bool:
        """Whether tracing two short models costs less than the whole one."""
        return self.traced + self.checked < self.depth

    def layer(self, name: str) -> int | None:
        """The layer a module name is in (``model.layers.5.mlp`` -> 5), or None."""
        head = self.path + "." if self.path else ""
        if not name.startswith(head):
            return None
        index = name[len(head) :].partition(".")[0]
        return int(index) if index.isdigit() else None

    def layer_name(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)

    def renamed(self, name: str, shift: int) -> str:
        """``name`` with its layer index moved by ``shift``."""
        layer = self.layer(name)
        if layer is None or not shift:
            return name
        head = self.path + "." if self.path else ""
        rest = name[len(head) :].partition(".")[2]
        return f"{head}{layer + shift}" + (f".{rest}" if rest else "")

    def describe(self) -> str:
        parts = [f"{self.depth} layers of {self.path or 'the model'}"]
        if self.prefix:
            parts.append(f"the first {self.prefix} unlike the rest")
        period = f"a period of {self.period}"
        if self.every > 1:
            period += f" (every {nth(self.every)} block checkpointed)"
        parts.append(period)
        return ", ".join(parts)


def find_stack(module: nn.Module, every: int = 1) -> Stack | None:
    """The largest ``ModuleList`` (by parameter elements) and its period; None where
    the model has none of at least two layers. ``every``: every that many blocks are
    checkpointed (``choices.layer_period``), a period that multiplies the layers'."""
    lists = [
        (sum(p.numel() for p in m.parameters()), name)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1
    ]
    lists = [x for x in lists if x[0]]
    if not lists:
        return None
    path = max(lists)[1]
    layers = module.get_submodule(path)
    signatures = [_signature(layer) for layer in layers]
    prefix, period = _period(signatures)
    return Stack(path, len(layers), prefix, math.lcm(period, every), every)


def _period(signatures: list) -> tuple[int, int]:
    """``(prefix, period)`` with the smallest traced depth: every layer from
    ``prefix`` on is like the one ``period`` later."""
    n = len(signatures)
    best = (n, n, n)  # (traced depth, prefix, period)
    for period in range(1, n):
        prefix = n - period  # the smallest prefix after which the pattern holds
        while prefix > 0 and signatures[prefix - 1] == signatures[prefix - 1 + period]:
            prefix -= 1
        tail = (n - prefix) % period
        cost = prefix + 3 * period + tail
        if cost < best[0]:
            best = (cost, prefix, period)
    return best[1], best[2]


def _signature(layer: nn.Module) -> tuple:
    out = []
    for name, m in layer.named_modules():
        settings = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_") and k not in INDEX_ATTRS and isinstance(v, _PLAIN)
            )
        )
        params = tuple(
            (n, tuple(p.shape), p.dtype, p.requires_grad)
            for n, p in m.named_parameters(recurse=False)
        )
        buffers = tuple(
            (n, tuple(b.shape), b.dtype)
            for n, b in m.named_buffers(recurse=False)
            if isinstance(b, torch.Tensor)
        )
        out.append((name, type(m).__qualname__, settings, params, buffers))
    return tuple(out)


@contextlib.contextmanager
def cut(module: nn.Module, stack: Stack, depth: int):
    """``module`` with the first ``depth`` layers of ``stack``, while the block runs
    (the same object: its stack is swapped and put back)."""
    layers = module.get_submodule(stack.path)
    parent, _, attr = stack.path.rpartition(".")
    owner = module.get_submodule(parent) if parent else module
    shorter = nn.ModuleList(list(layers)[:depth])
    config = getattr(module, "config", None)
    saved = _config_depth(config, stack.depth, depth)
    setattr(owner, attr, shorter)
    try:
        yield module
    finally:
        setattr(owner, attr, layers)
        for key, value in saved.items():
            setattr(config, key, value)


def _config_depth(config, depth: int, new: int) -> dict:
    """Set a Hugging Face config's layer count (and per-layer lists) to ``new``; what
    to put back."""
    saved = {}
    if config is None:
        return saved
    for key in (*LAYER_KEYS, "layer_types"):
        value = getattr(config, key, None)
        if key == "layer_types" and isinstance(value, list) and len(value) == depth:
            saved[key] = value
            setattr(config, key, value[:new])
        elif isinstance(value, int) and not isinstance(value, bool) and value == depth:
            saved[key] = value
            setattr(config, key, new)
    return saved
