"""A ``ModelSpec`` from a live or meta-device ``nn.Module``.

Tied parameters are found by identity: a parameter object reachable under several
names (GPT-2's ``lm_head.weight is transformer.wte.weight``, a module registered in
two places) becomes one record whose other names are its ``aliases``. Nothing is
guessed from names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from . import dtypes
from .records import ModelSpec, TensorRecord
from .units import pick_stacks


def module_kinds(module: nn.Module) -> tuple[str, ...]:
    """The filter kinds (``linear``, ``embedding``, ``conv``, ``norm``) of a module.

    Subclasses of torch's layers count, and so do the usual look-alikes by class
    name: Hugging Face's GPT-2 ``Conv1D`` is a linear layer, ``LlamaRMSNorm`` a norm.
    """
    cls = type(module).__name__
    if isinstance(module, nn.Linear) or cls == "Conv1D" or cls.endswith("Linear"):
        return ("linear",)
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or cls.endswith("Embedding"):
        return ("embedding",)
    if isinstance(module, nn.modules.conv._ConvNd):
        return ("conv",)
    norms = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
    if isinstance(module, norms) or "Norm" in cls:
        return ("norm",)
    return ()


@dataclass
class _Owned:
    """A tensor and every (module, attribute) that holds it, while collecting."""

    tensor: torch.Tensor
    is_param: bool
    persistent: bool
    names: list[str] = field(default_factory=list)
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)


def collect_tensors(module: nn.Module) -> list[_Owned]:
    """Parameters and buffers of ``module``, one per tensor object, in state-dict order."""
    found: dict[int, _Owned] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for attr, t in mod._parameters.items():
            _collect(found, prefix, mod, attr, t, True, True)
        for attr, t in mod._buffers.items():
            persistent = attr not in mod._non_persistent_buffers_set
            _collect(found, prefix, mod, attr, t, False, persistent)
    return list(found.values())


def _collect(found, prefix, mod, attr, t, is_param, persistent) -> None:
    if t is None:
        return
    item = found.setdefault(id(t), _Owned(t, is_param, persistent))
    item.names.append(f"{prefix}.{attr}" if prefix else attr)
    item.owners.append((mod, attr))


def _record(item: _Owned) -> TensorRecord:
    mods = [m for m, _ in item.owners]
    kinds = dict.fromkeys(k for m in mods for k in module_kinds(m))
    return TensorRecord(
        name=item.names[0],
        shape=tuple(item.tensor.shape),
        dtype=dtypes.from_torch(item.tensor.dtype),
        aliases=tuple(item.names[1:]),
        is_param=item.is_param,
        requires_grad=bool(item.tensor.requires_grad) if item.is_param else False,
        persistent=item.persistent,
        module_types=tuple(dict.fromkeys(type(m).__name__ for m in mods)),
        kinds=tuple(kinds),
    )


def detect_units(module: nn.Module) -> tuple[str, ...]:
    """Children of the ``ModuleList`` holding the most parameter elements, and of
    any other list, not nested in a chosen one, at least half as large (T5's
    encoder and decoder stacks)."""
    lists = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1:
            numel = sum(p.numel() for p in mod.parameters())
            if numel:
                lists.append((numel, name))
    chosen = pick_stacks(lists, _nested)
    order = {n: i for i, (n, _) in enumerate(module.named_modules())}
    units = []
    for name in sorted(chosen, key=order.get):
        children = module.get_submodule(name).named_children()
        units += [f"{name}.{child}" if name else child for child, _ in children]
    return tuple(units)


def _nested(a: str, b: str) -> bool:
    """Whether module ``a`` is inside ``b`` or ``b`` inside ``a`` (or the same)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def spec_from_module(
    module: nn.Module, *, source: str = "", source_kind: str = "module", notes=()
) -> ModelSpec:
    """Describe ``module`` (real, meta or fake tensors) without copying any data."""
    items = collect_tensors(module)
    names = tuple(n for n, _ in module.named_modules(remove_duplicate=False) if n)
    return ModelSpec(
        tensors=tuple(_record(i) for i in items),
        has_architecture=True,
        units=detect_units(module),
        module_names=tuple(dict.fromkeys(names)),
        notes=tuple(notes),
        source=source,
        source_kind=source_kind,
    )
