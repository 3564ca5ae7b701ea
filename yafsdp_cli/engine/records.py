"""What the library knows about a model without holding its weights.

A ``ModelSpec`` is the common currency between sources (safetensors header, state
dict, live or meta-device module) and everything downstream (filters, units,
layout, memory model, checkpoint writer). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from . import dtypes

# Module kinds that filters can name; a module that is none of these has no kind.
MODULE_KINDS = ("linear", "embedding", "conv", "norm")


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of a model: a parameter or a module buffer, stored once.

    ``aliases`` are the other full names of the same tensor (tied owners such as
    GPT-2's ``lm_head.weight`` for ``transformer.wte.weight``); ``name`` is the first
    name in module order.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # canonical dtype name, see dtypes.py
    aliases: tuple[str, ...] = ()
    is_param: bool = True  # False: a module buffer (BatchNorm statistics, rotary tables)
    requires_grad: bool = True
    persistent: bool = True  # False: a non-persistent buffer, absent from state dicts
    module_types: tuple[str, ...] = ()  # class name of every owner; empty without architecture
    kinds: tuple[str, ...] = ()  # MODULE_KINDS of the owners

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    @property
    def floating(self) -> bool:
        return dtypes.is_floating(self.dtype)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Names, shapes, dtypes and structure of a model, from any source."""

    tensors: tuple[TensorRecord, ...]
    has_architecture: bool
    units: tuple[str, ...] = ()  # auto-detected unit module names, in model order
    module_names: tuple[str, ...] = ()  # every module name (architecture) or name prefix
    notes: tuple[str, ...] = ()  # caveats to show the user ("tied weights cannot be known")
    source: str = ""  # what was loaded, for reports
    source_kind: str = ""  # "safetensors", "state_dict", "module", "hf", ...
    metadata: dict[str, str] = field(default_factory=dict)
    # False: the source records no dtype (an HF config saved without dtype/torch_dtype):
    # the records hold float32, torch's default, and every command trains such a model
    # in one dtype (``options.training_dtype``)
    dtype_stored: bool = True

    @property
    def params(self) -> tuple[TensorRecord, ...]:
        return tuple(t for t in self.tensors if t.is_param)

    @property
    def buffers(self) -> tuple[TensorRecord, ...]:
        return tuple(t for t in self.tensors if not t.is_param)

    def by_name(self) -> dict[str, TensorRecord]:
        """Every name, aliases included, to its record."""
        return {n: t for t in self.tensors for n in t.names}


def retype_params(spec: ModelSpec, param_dtype: str | None, keep_frozen: bool = False) -> ModelSpec:
    """Every floating-point parameter in ``param_dtype`` (module buffers unchanged;
    ``keep_frozen``: parameters that do not train too, as a LoRA base, see
    ``profiling.precision.cast_params``); ``param_dtype`` comes from a validated
    ``StepOptions``."""
    if not param_dtype:
        return spec
    target = dtypes.canonical(param_dtype)
    tensors = tuple(
        dataclasses.replace(t, dtype=target)
        if t.is_param and t.floating and (t.requires_grad or not keep_frozen)
        else t
        for t in spec.tensors
    )
    return dataclasses.replace(spec, tensors=tensors)
