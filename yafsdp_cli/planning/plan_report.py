"""What ``plan`` answers: the fits grid and its rows (frozen dataclasses; bytes only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..memory.headroom import Fit
from ..memory.outside_allocator import OutsidePart
from .cell import Cell
from .plan_options import PlanOptions

if TYPE_CHECKING:
    from ..timing import StepEstimate

SCHEMA = "yafsdp.plan/1"
# a field the ``yafsdp.plan/1`` document leaves out (``report.formatting.plain``): the
# ``Fit`` a row carries, whose figures the document gives as the row's own fields
NOT_WRITTEN = {"json": False}


@dataclass(frozen=True, slots=True)
class PlanBreakdown:
    """One rank's bytes at the step's peak. The first seven come from the memory model
    (``estimate_memory(...).flat``); ``activations`` grows with micro-batch x sequence;
    ``temporaries`` is the measured rest (may be negative where gradients are not
    all allocated yet at the peak)."""

    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int
    gather: int
    reduce: int
    activations: int
    temporaries: int


@dataclass(frozen=True, slots=True)
class AllocAdvice:
    """Another caching-allocator setting under which a cell fits, and its figures."""

    alloc_conf: str  # in PYTORCH_CUDA_ALLOC_CONF syntax
    export: str  # the shell line that sets it for the training job
    reserved_bytes: int  # the predicted reserved peak under it
    needed_bytes: int  # reserved_bytes + the memory beside the allocator
    fit: Fit = field(metadata=NOT_WRITTEN)  # the verdict under this setting


@dataclass(frozen=True, slots=True)
class PlanRow:
    world_size: int
    micro_batch: int
    seq_len: int
    checkpointing: str
    peak_bytes: int  # the training step's allocated peak per rank
    needed_bytes: int  # reserved_bytes + the outside parts: what the GPU must have
    breakdown: PlanBreakdown
    peak_phase: str  # forward | backward | optimizer
    fits: bool  # needed_bytes <= GPU memory, under the plan's allocator setting
    reserved_bytes: int  # the caching allocator's predicted reserved peak
    fragmentation_bytes: int  # reserved_bytes - peak_bytes
    outside: tuple[OutsidePart, ...]  # held beside the allocator: context, workspaces, NCCL
    fits_with: AllocAdvice | None  # when it fits only under another allocator setting
    # the micro-batch (1 = the first) of the step's --grad-accum ones the peak is in;
    # an optimizer peak: the last, after which it runs
    peak_micro_batch: int = 1
    time: StepEstimate | None = None  # the step on the plan's GPU (``cell_time``); None: no GPU
    # the verdict under the plan's allocator setting (``memory.headroom.fit``): ``fits``
    # and ``needed_bytes`` are its figures; what the views show. Always set by a plan.
    fit: Fit | None = field(default=None, metadata=NOT_WRITTEN)

    @property
    def cell(self) -> Cell:
        return Cell.at(self.world_size, self.micro_batch, self.checkpointing)


@dataclass(frozen=True, slots=True)
class Smallest:
    micro_batch: int
    checkpointing: str
    world_size: int | None  # None: no world size of the grid fits


@dataclass(frozen=True, slots=True)
class PastPositions:
    """The position limit a model's config states, where the plan's sequence is
    longer: a rotary model runs past it, but was trained only that long."""

    key: str  # the config key (``max_position_embeddings``)
    positions: int


@dataclass(frozen=True, slots=True)
class PlanAdvice:
    """A configuration better than the best (more tokens per rank, or any when nothing
    fits) that fits only under another allocator setting."""

    alloc_conf: str
    export: str
    row: PlanRow


@dataclass(frozen=True, slots=True)
class PlanReport:
    source: str
    gpu_memory_bytes: int
    reserve_bytes: int | None  # --reserve: the outside parts' sum, given; None: itemised
    round_bytes: int
    seq_len: int
    param_dtype: str
    grad_dtype: str
    optimizer: str
    optimizer_impl: str
    grad_accum: int  # micro-batches per optimizer step (--grad-accum)
    world_sizes: tuple[int, ...]
    micro_batches: tuple[int, ...]
    checkpointing: tuple[str, ...]
    rows: tuple[PlanRow, ...]
    smallest: tuple[Smallest, ...]
    best: PlanRow | None
    fake_runs: int  # the cells measured, each its own step's figures
    fake_steps: int  # the fake steps they took: above world size 1, one per micro-batch
    wall_s: float
    notes: tuple[str, ...]
    alloc_conf: str | None  # the allocator setting the rows fit under; None: --target cpu
    margin_bytes: int  # what the best row keeps free
    advice: PlanAdvice | None
    source_path: str | None = None  # what was given, so `check` can plan it again
    model: str | None = None
    options: PlanOptions | None = None
    schemes: tuple = ()  # scheme_peaks.SchemePlan per --scheme; () for the flat scheme alone
    timing: PlanTiming | None = None  # where the plan names a GPU (``cell_time``)
    # a fine-tuning step's LoRA, quantized base and frozen parameters, in a few words
    # each (``sources.adapted``); () for a full fine-tune
    tuning: tuple[str, ...] = ()
    past_positions: PastPositions | None = None  # where seq_len is past the config's limit
    loss: str = "projection"  # as --loss names it, the model's default resolved
    loss_detail: str = ""  # the loss in words: what it holds at the best row's micro-batch


@dataclass(frozen=True, slots=True)
class PlanTiming:
    """What the cells were timed on and how the best row was chosen."""

    gpu: str
    gpu_source: str  # the datasheet, or the profile file's source
    network_bytes_per_s: float  # inter-node, per GPU
    efficiency: dict[str, float]  # the roofline's: matrix, vector, memory, kernel_floor_s
    objective: str
    tokens: int | None  # to train on (``--tokens``)
    gpu_hours: float | None  # the best row's, for ``tokens``
    wall_hours: float | None
    count_runs: int  # fake steps counted for the kernels' costs
