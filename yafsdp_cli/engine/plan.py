"""From a model description and the user's options to a checked layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .filters import select
from .layout import AlignSpec, Layout, plan_layout
from .records import ModelSpec
from .units import assign_units, resolve_units


class LayoutChoice(Protocol):
    """What a layout is planned from: ``options.LayoutOptions`` (the engine cannot
    import the options room, which sits above it, so it names the fields it reads)."""

    filters: Sequence[str]
    excludes: Sequence[str]
    units: Sequence[str] | None
    world_size: int
    align: AlignSpec | str


@dataclass(frozen=True, slots=True)
class _Defaults:
    """``LayoutOptions()``'s choices: every floating parameter, the repeated blocks."""

    filters: Sequence[str] = ()
    excludes: Sequence[str] = ()
    units: Sequence[str] | None = None
    world_size: int = 1
    align: AlignSpec | str = "yafsdp"


def plan(spec: ModelSpec, layout: LayoutChoice | None = None) -> Layout:
    """Select parameters, group them into units and pack them into flat buffers, as
    the layout options ``layout`` say (None: the defaults).

    >>> from yafsdp_cli import LayoutOptions, ModelSpec, TensorRecord, plan
    >>> spec = ModelSpec((TensorRecord("w", (3, 5), "float32"),), has_architecture=False)
    >>> layout = plan(spec, LayoutOptions(world_size=4))
    >>> layout.buffers[0].padded_numel  # 15 elements padded to 4 ranks x 8
    32
    """
    choice = _Defaults() if layout is None else layout
    selected = select(spec, choice)
    unit_names, split = resolve_units(spec, choice.units)
    unit_of = assign_units(spec, unit_names)
    return plan_layout(spec, selected, unit_of, choice, units=unit_names, split=split)
