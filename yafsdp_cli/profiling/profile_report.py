"""What ``profile`` answers: its frozen results (bytes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory.outside_allocator import OutsideAllocator
from .micro_batches import MicroTrace
from .periodic import PeriodicTrace
from .timeline import Breakdown, ModuleMemory, PhaseSeries

SCHEMA = "yafsdp.profile/1"


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """``torch.cuda`` peaks over the tracked step (only with a GPU)."""

    allocated_peak: int
    reserved_peak: int


@dataclass(frozen=True, slots=True)
class ReservedPeak:
    """What CUDA's caching allocator reserves for the step (``--target cuda``): the
    step's allocations and frees replayed through ``memory.caching_allocator``, and
    what a GPU must hold with the memory outside it (``ProfileReport.outside``)."""

    alloc_conf: str  # the replay's settings, PYTORCH_CUDA_ALLOC_CONF syntax ("default")
    reserved_peak: int  # predicted torch.cuda.max_memory_reserved over the step
    allocated_at_peak: int  # allocated blocks when reserved peaked
    fragmentation: int  # reserved_peak - allocated_at_peak: cached, unused, at the peak
    outside_bytes: int  # the CUDA context, cuBLAS workspaces, NCCL buffers
    gpu_bytes: int  # reserved_peak + outside_bytes: what the GPU must hold


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
    reserved: ReservedPeak | None = None  # CUDA's caching allocator's figures (target cuda)
    # each phase's peak by category (``phase_peaks`` split): what the schemes' rows
    # take the step's own bytes from
    phase_breakdowns: dict[str, Breakdown] = field(default_factory=dict)
    # with --grad-accum: the micro-batch (1 = the first) the peak, and each phase's,
    # was first reached in (the optimizer's: the last, after which it runs)
    peak_micro_batch: int = 1
    phase_micro_batches: dict[str, int] = field(default_factory=dict)
    micro: MicroTrace | None = None  # how its micro-batches were had


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
    loss: str  # as --loss names it (the model's default resolved), e.g. "chunked-ce:8"
    inputs: str  # e.g. "input_ids (1, 4096) int64"
    round_bytes: int  # every storage rounded up to this (CUDA's allocator: 512)
    flat_buffers: int
    converted: int
    kept: int
    original: StepProfile
    converted_step: StepProfile
    kernels: dict[str, int]  # substituted CUDA attention kernels, by kind (--target cuda)
    notes: tuple[str, ...] = ()
    outside: OutsideAllocator | None = None  # GPU memory beside the allocator (target cuda)
    training_dtype: str = ""  # which dtype the parameters are trained in, and why
    trace: PeriodicTrace | None = None  # how the steps were had: one period repeated, or whole
    loss_detail: str = ""  # the loss in words: what it holds
    grad_accum: int = 1  # micro-batches per optimizer step

    @property
    def saving_bytes(self) -> int:
        return self.original.peak.total - self.converted_step.peak.total
