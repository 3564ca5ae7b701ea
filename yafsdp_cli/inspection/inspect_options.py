"""What ``inspect`` is asked: the layout, the step's optimizer and dtypes, the memory
configuration."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import Composed, LayoutOptions, MemoryOptions, StepOptions


@dataclass(frozen=True, kw_only=True, slots=True, init=False)
class InspectOptions(Composed):
    """Of the step, the memory model reads the optimizer (``None``: a DCP checkpoint's
    own, else adamw) and the dtypes; of the memory piece, rounding, master weights and
    FSDP2's placement."""

    FIELDS = (
        "filters",
        "excludes",
        "units",
        "world_size",
        "align",
        "param_dtype",
        "grad_dtype",
        "freeze",
        "lora",
        "quantize",
        "optimizer",
        "master_weights",
        "round_bytes",
        "fsdp_placement",
    )
    DEFAULTS = {"optimizer": None, "round_bytes": 512}

    layout: LayoutOptions
    step: StepOptions
    memory: MemoryOptions
