"""What ``profile`` takes and gives: its options and its frozen results (bytes)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.idioms import check_checkpointing
from ..engine.step import check_optimizer
from ..errors import YafsdpError
from .precision import check_training_dtypes
from .tracker import Breakdown, ModuleMemory, PhaseSeries

SCHEMA = "yafsdp.profile/1"
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileOptions:
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    filters: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    units: tuple[str, ...] | None = None
    world_size: int = 1
    align: str = "yafsdp"
    batch: int = 2
    seq_len: int = 16
    input_shape: tuple[int, ...] | None = None
    seed: int = 0
    fake: bool = False
    per_module: bool = False
    depth: int = 3  # per-module rows: module names with at most this many parts
    modules: int = 0  # rows of the breakdown of the peak by module (0: none)
    device: str = "cpu"
    target: str | None = None  # whose kernels are accounted; None: the device's
    checkpointing: str = "none"  # none | reentrant | non-reentrant, per unit
    param_dtype: str | None = None  # training dtype of floating parameters; None: as stored
    grad_dtype: str | None = None  # None: the parameter's dtype
    round_bytes: int | None = None  # None: 512 for CUDA's kernels (the caching allocator), else 1

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer, self.optimizer_impl)
        for name in ("world_size", "batch", "seq_len", "depth"):
            if getattr(self, name) < 1:
                flag = name.replace("_", "-")
                raise YafsdpError(f"--{flag} must be at least 1, got {getattr(self, name)}")
        if self.modules < 0:
            raise YafsdpError(f"--modules must be 0 or more, got {self.modules}")
        if self.device not in DEVICES:
            raise YafsdpError(f"--device {self.device!r} is not cpu or cuda")
        if self.target is not None and self.target not in DEVICES:
            raise YafsdpError(f"--target {self.target!r} is not cpu or cuda")
        check_checkpointing(self.checkpointing)
        check_training_dtypes(self.param_dtype, self.grad_dtype)
        if self.round_bytes is not None and self.round_bytes < 1:
            raise YafsdpError(f"--round-bytes must be at least 1, got {self.round_bytes}")

    @property
    def kernels(self) -> str:
        """The device whose kernels the figures are for."""
        return self.target or self.device


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """``torch.cuda`` peaks over the tracked step (only with a GPU)."""

    allocated_peak: int
    reserved_peak: int


@dataclass(frozen=True, slots=True)
class ModuleShare:
    """Activation bytes alive at the step's peak that modules of one name pattern made
    (``model.layers.*.mlp.up_proj``: every layer's ``up_proj``, ``count`` of them)."""

    name: str
    kind: str  # the module class
    count: int
    bytes: int


@dataclass(frozen=True, slots=True)
class StepProfile:
    variant: str  # "original" or "converted"
    peak: Breakdown  # bytes alive at the step's peak, by category
    peak_phase: str  # forward | backward | optimizer
    phase_peaks: dict[str, int]  # the highest total in each phase
    end: Breakdown  # alive after zero_grad: what the next step starts from
    modules: tuple[ModuleMemory, ...]
    peak_modules: tuple[ModuleShare, ...]  # the largest makers of the peak's activations
    cuda: CudaMemory | None
    ops: int
    wall_s: float
    series: tuple[PhaseSeries, ...] = ()  # bytes alive through each phase, for charts


@dataclass(frozen=True, slots=True)
class ProfileReport:
    source: str
    fake: bool
    device: str
    target: str  # whose kernels: cpu, or cuda (on a GPU, or substituted under --fake)
    world_size: int  # the converted model runs as rank 0 of this many
    optimizer: str
    optimizer_impl: str
    checkpointing: str
    inputs: str  # e.g. "input_ids (1, 4096) int64"
    round_bytes: int  # every storage rounded up to this (CUDA's allocator: 512)
    flat_buffers: int
    converted: int
    kept: int
    original: StepProfile
    converted_step: StepProfile
    kernels: dict[str, int]  # substituted CUDA attention kernels, by kind (--target cuda)
    notes: tuple[str, ...] = ()

    @property
    def saving_bytes(self) -> int:
        return self.original.peak.total - self.converted_step.peak.total
