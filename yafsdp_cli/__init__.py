"""yafsdp: flat-buffer (metaparam) layouts, memory models and conversion for PyTorch.

The public API is small; importing this package does not import torch, so a layout
or memory report from a safetensors header costs no torch start-up. Names that need
torch (``convert_module``, ``spec_from_module``...) load it on first use.

>>> from yafsdp_cli import LayoutOptions, ModelSpec, TensorRecord, plan
>>> spec = ModelSpec((TensorRecord("w", (8, 8), "bfloat16"),), has_architecture=False)
>>> plan(spec, LayoutOptions(world_size=2)).buffers[0].name
'__flat__.bfloat16'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import lazy
from .engine.layout import AlignSpec, BufferLayout, FlatEntry, Layout, ShardPiece, parse_align
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

# Names imported on first use (``lazy.py`` says why): the ones that need torch, and
# ``plan``, whose filters a command that only copies bytes never uses.
_LAZY = {
    "plan": "engine.plan",
    "LayoutOptions": "options.pieces",
    "convert_module": "engine.flat",
    "FlatModel": "engine.flat",
    "spec_from_module": "engine.module_spec",
}

if TYPE_CHECKING:
    from .engine.flat import FlatModel, convert_module
    from .engine.module_spec import spec_from_module
    from .engine.plan import plan
    from .options.pieces import LayoutOptions


def __getattr__(name: str):
    return lazy.attribute(__name__, _LAZY, name)


__all__ = [
    "AlignSpec",
    "BufferLayout",
    "FlatModel",
    "CheckpointError",
    "ConversionError",
    "FilterError",
    "FlatEntry",
    "Layout",
    "LayoutError",
    "LayoutOptions",
    "ModelSpec",
    "ShardPiece",
    "SourceError",
    "TensorRecord",
    "YafsdpError",
    "convert_module",
    "parse_align",
    "plan",
    "spec_from_module",
]
