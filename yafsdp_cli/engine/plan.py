"""From a model description and the user's options to a checked layout."""

from __future__ import annotations

from collections.abc import Sequence

from .filters import select
from .layout import AlignSpec, Layout, plan_layout
from .records import ModelSpec
from .units import assign_units, resolve_units


def plan(
    spec: ModelSpec,
    *,
    filters: Sequence[str] = (),
    excludes: Sequence[str] = (),
    units: Sequence[str] | None = None,
    world_size: int = 1,
    align: AlignSpec | str = "yafsdp",
) -> Layout:
    """Select parameters, group them into units and pack them into flat buffers.

    >>> from yafsdp_cli import ModelSpec, TensorRecord, plan
    >>> spec = ModelSpec((TensorRecord("w", (3, 5), "float32"),), has_architecture=False)
    >>> layout = plan(spec, world_size=4)
    >>> layout.buffers[0].padded_numel  # 15 elements padded to 4 ranks x 8
    32
    """
    selected = select(spec, filters, excludes)
    unit_names = resolve_units(spec, units)
    unit_of = assign_units(spec, unit_names)
    return plan_layout(
        spec, selected, unit_of, world_size=world_size, align=align, units=unit_names
    )
