"""What ``inspect`` is asked: the layout, the step's optimizer and dtypes, the memory
configuration."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import LayoutOptions, MemoryOptions, StepOptions

# inspect's own defaults: a DCP checkpoint's own optimizer (else adamw), CUDA's rounding
INSPECT_STEP = StepOptions(optimizer=None)
INSPECT_MEMORY = MemoryOptions(round_bytes=512)


@dataclass(frozen=True, kw_only=True, slots=True)
class InspectOptions:
    """Of the step, the memory model reads the optimizer (``None``: a DCP checkpoint's
    own, else adamw) and the dtypes; of the memory piece, rounding, master weights and
    FSDP2's placement."""

    layout: LayoutOptions = LayoutOptions()
    step: StepOptions = INSPECT_STEP
    memory: MemoryOptions = INSPECT_MEMORY
