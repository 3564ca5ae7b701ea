"""``verify --blocks SPEC``: the model built with some of its repeated blocks, with
their real weights.

SPEC is a count (``2``: the first and the last block; ``K``: K blocks spread evenly,
first and last included), a list of block indices (``0,17,31``) or ``all``. The
model is built with ``len(kept)`` blocks; block ``j`` gets the weights of block
``kept[j]`` (``model.layers.17.mlp.up_proj.weight`` loads into
``model.layers.1.mlp.up_proj.weight``); everything outside the blocks (embeddings,
tied heads, final norm, buffers) is the model's own, whole, ties included.

Where the depth comes from: a Hugging Face folder's config (``num_hidden_layers``,
``n_layer``, ``num_layers`` or ``n_layers``; a per-layer ``layer_types`` list is cut
to the kept blocks too), or a ``--model`` factory that takes the depth as an argument
(``n_layer``, ``num_layers``, ``depth``, ...). Anything else is an error that says so.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..engine.module_spec import collect_tensors
from ..errors import YafsdpError
from ..numbers import shown

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
DEPTH_ARGS = (*LAYER_KEYS, "depth", "layers", "n_blocks", "num_blocks")


@dataclass(frozen=True, slots=True)
class BlockChoice:
    """Which of the model's repeated blocks verify built, and why."""

    kept: tuple[int, ...]  # indices into the original's blocks, in order
    total: int  # blocks the model has
    stack: str  # the ModuleList holding them, e.g. "model.layers"
    why: str  # "--blocks 2", or why verify chose them itself

    @property
    def whole(self) -> bool:
        return len(self.kept) == self.total


@dataclass(frozen=True, slots=True)
class Blocked:
    """How to build this source with fewer blocks."""

    total: int
    stack: str
    build: Callable[[Sequence[int]], nn.Module]  # kept indices -> a module (random init)
    where: str  # "config.json num_hidden_layers", "factory argument n_layer"


def spread(count: int, total: int) -> tuple[int, ...]:
    """``count`` block indices out of ``total``, evenly spaced, first and last kept."""
    if count >= total:
        return tuple(range(total))
    if count == 1:
        return (0,)
    return tuple(sorted({round(i * (total - 1) / (count - 1)) for i in range(count)}))


def parse_blocks(spec: str, total: int) -> tuple[int, ...]:
    """``"2"`` -> first and last; ``"0,17,31"`` -> those; ``"all"`` -> every block."""
    text = spec.strip().lower()
    if text == "all":
        return tuple(range(total))
    try:
        numbers = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:  # not digits, or more than Python converts
        numbers = []
    if not numbers:
        raise YafsdpError(f"--blocks {shown(spec)!r}: give a count (2), indices (0,17,31) or all")
    if "," not in text:
        (count,) = numbers
        if not 1 <= count <= total:
            raise YafsdpError(
                f"--blocks {shown(spec)}: the model has {total} blocks; give 1 to {total}"
            )
        return spread(count, total)
    bad = [n for n in numbers if not 0 <= n < total]
    if bad or len(set(numbers)) != len(numbers):
        why = f"{shown(bad[0])} is not a block index" if bad else "an index is repeated"
        raise YafsdpError(f"--blocks {shown(spec)}: {why}; the model has blocks 0 to {total - 1}")
    return tuple(sorted(numbers))


def _stack_of(module: nn.Module, total: int) -> str:
    """The largest ModuleList of ``total`` children: the repeated blocks."""
    lists = [
        (sum(p.numel() for p in m.parameters()), name)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == total
    ]
    if not lists:
        raise YafsdpError(f"--blocks: the model has no list of {total} blocks")
    return max(lists)[1]


def blocked_source(loaded) -> Blocked:
    """How ``loaded`` (a ``sources.LoadedModel``) builds with fewer blocks."""
    factory = loaded.factory
    if hasattr(factory, "with_config"):
        return _hf_blocked(loaded, factory)
    arg = _depth_arg(factory)
    if arg is None:
        raise YafsdpError(
            f"--blocks: {loaded.spec.source} has no depth to change: give a Hugging Face "
            "folder (its config's layer count) or a --model factory that takes the depth as "
            f"an argument ({', '.join(DEPTH_ARGS[:4])}, depth)"
        )
    default = inspect.signature(factory).parameters[arg].default
    meta = loaded.module
    total = default if isinstance(default, int) else len(_largest_list(meta))
    stack = _stack_of(meta, total)
    return Blocked(
        total, stack, lambda kept: factory(**{arg: len(kept)}), f"factory argument {arg}"
    )


def _largest_list(module: nn.Module) -> nn.ModuleList:
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise YafsdpError("--blocks: the model has no repeated blocks (no nn.ModuleList)")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _depth_arg(factory) -> str | None:
    if factory is None:
        return None
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None
    return next((a for a in DEPTH_ARGS if a in params), None)


def _hf_blocked(loaded, factory) -> Blocked:
    cfg = factory.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise YafsdpError(
            "--blocks: an encoder-decoder model has two stacks of blocks; verify it whole"
        )
    key = next((k for k in LAYER_KEYS if isinstance(getattr(cfg, k, None), int)), None)
    if key is None:
        raise YafsdpError(f"--blocks: config.json has no layer count ({', '.join(LAYER_KEYS)})")
    total = getattr(cfg, key)
    stack = _stack_of(loaded.module, total)

    def build(kept: Sequence[int]) -> nn.Module:
        smaller = copy.deepcopy(cfg)
        setattr(smaller, key, len(kept))
        types = getattr(cfg, "layer_types", None)
        if isinstance(types, list) and len(types) == total:
            smaller.layer_types = [types[i] for i in kept]
        return factory.with_config(smaller)()

    return Blocked(total, stack, build, f"config.json {key}")


def build_meta(blocked: Blocked, kept: Sequence[int]) -> nn.Module:
    with torch.device("meta"):
        return blocked.build(kept)


def build_with_blocks(loaded, blocked: Blocked, kept: Sequence[int]) -> nn.Module:
    """A real module with ``kept`` blocks, loaded with those blocks' weights."""
    torch.manual_seed(0)
    module = blocked.build(kept)
    got = len(module.get_submodule(blocked.stack))
    if got != len(kept):
        raise YafsdpError(
            f"--blocks: asked the architecture for {len(kept)} blocks, {blocked.stack} has {got}"
        )
    if loaded.reader is not None:
        _load_renamed(module, loaded, blocked.stack, kept)
    return module


def original_name(name: str, stack: str, kept: Sequence[int]) -> str:
    """``model.layers.1.x`` -> ``model.layers.17.x`` when ``kept[1] == 17``."""
    prefix = stack + "."
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    return f"{prefix}{kept[int(index)]}.{rest}"


def _load_renamed(module: nn.Module, loaded, stack: str, kept: Sequence[int]) -> None:
    by_name = loaded.spec.by_name()
    with torch.no_grad():
        for item in collect_tensors(module):
            record = by_name.get(original_name(item.names[0], stack, kept))
            if record is None or not record.persistent:
                continue
            src = loaded.reader.load(loaded.stored_name(record))
            if tuple(src.shape) != tuple(item.tensor.shape):
                raise YafsdpError(
                    f"--blocks: {record.name} is {tuple(src.shape)} in the weights, "
                    f"{tuple(item.tensor.shape)} in the model built with fewer blocks"
                )
            if item.tensor.dtype != src.dtype:
                item.tensor.data = item.tensor.data.to(src.dtype)
            item.tensor.copy_(src)
