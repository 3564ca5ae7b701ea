"""yafsdp: flat-buffer (metaparam) layouts, memory models and conversion for PyTorch.

The public API is small; importing this package does not import torch, so a layout
or memory report from a safetensors header costs no torch start-up. Names that need
torch (``convert_module``, ``spec_from_module``...) load it on first use.

>>> from yafsdp_cli import ModelSpec, TensorRecord, plan
>>> spec = ModelSpec((TensorRecord("w", (8, 8), "bfloat16"),), has_architecture=False)
>>> plan(spec, world_size=2).buffers[0].name
'__flat__.bfloat16'
"""

from __future__ import annotations

from .engine.layout import AlignSpec, BufferLayout, FlatEntry, Layout, ShardPiece, parse_align
from .engine.plan import plan
from .engine.records import ModelSpec, TensorRecord
from .errors import (
    CheckpointError,
    ConversionError,
    FilterError,
    LayoutError,
    SourceError,
    YafsdpError,
)

__version__ = "0.1.0"

_LAZY = {
    "convert_module": "engine.flat",
    "FlatModel": "engine.flat",
    "spec_from_module": "engine.module_spec",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AlignSpec",
    "BufferLayout",
    "CheckpointError",
    "ConversionError",
    "FilterError",
    "FlatEntry",
    "Layout",
    "LayoutError",
    "ModelSpec",
    "ShardPiece",
    "SourceError",
    "TensorRecord",
    "YafsdpError",
    "parse_align",
    "plan",
    *_LAZY,
]
