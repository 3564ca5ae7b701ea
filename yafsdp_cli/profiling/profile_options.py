"""What ``profile`` is asked: the layout, the step and the memory pieces, and its own."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import LayoutOptions, MemoryOptions, StepOptions, check_at_least


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    layout: LayoutOptions = LayoutOptions()
    step: StepOptions = StepOptions()
    # round_bytes None: 512 for CUDA's kernels (the caching allocator), 1 for the CPU's
    memory: MemoryOptions = MemoryOptions()
    fake: bool = False
    per_module: bool = False
    depth: int = 3  # per-module rows: module names with at most this many parts
    modules: int = 0  # rows of the breakdown of the peak by module (0: none)
    # --fake: trace one period of the layer stack and repeat it (``periodic``), checked
    # against a trace one period deeper; False: trace every layer (--trace whole)
    periodic: bool = True

    def __post_init__(self) -> None:
        check_at_least("depth", self.depth)
        check_at_least("modules", self.modules, 0)

    @property
    def kernels(self) -> str:
        """The device whose kernels the figures are for."""
        return self.step.kernels
