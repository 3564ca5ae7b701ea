"""The three pieces every command's options are made of, each validated once."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import dtypes
from ..engine.choices import (
    check_checkpointing,
    check_device,
    check_optimizer,
    check_placement,
    parse_loss,
)
from ..engine.filters import parse_filter
from ..engine.finetune import parse_lora
from ..engine.packed import check_quantize
from ..errors import YafsdpError
from ..numbers import (
    MAX_BYTES,
    MAX_COUNT,
    MAX_GRAD_ACCUM,
    MAX_ROUND_BYTES,
    MAX_SEED,
    MAX_SEQ_LEN,
    checked,
    problem,
    shown,
)
from .alloc_conf import ALLOC_CONF_FLAG, parse_alloc_conf
from .sizes import OUTSIDE_PARTS

GiB = 1024**3
# CUDA's caching allocator hands out multiples of 512 bytes; a CPU storage holds its
# own bytes. One rule for every command (``MemoryOptions.rounding``).
CUDA_ROUND_BYTES = 512
# The headroom a plan's best configuration keeps, as a fraction of the GPU's memory:
# the reserved-memory model's predictions on the H200 runs span x0.991 to x1.026 of
# torch.cuda.max_memory_reserved (benchmarks/gpu/reserved-h200.log), so 3% of a GPU
# covers an error of that size at a peak that fills the GPU.
DEFAULT_MARGIN = 0.03


def check_at_least(
    flag: str, value: int | None, minimum: int = 1, maximum: int = MAX_COUNT
) -> None:
    """``--flag`` is ``None`` (the default choice) or a whole number from ``minimum``
    to ``maximum`` (``numbers.checked``: NaN, infinities and 400-digit integers are
    refused by name)."""
    if value is not None:
        checked(value, f"--{flag}", minimum, maximum, whole=True)


def check_training_dtypes(param_dtype: str | None, grad_dtype: str | None) -> None:
    for flag, name in (("--param-dtype", param_dtype), ("--grad-dtype", grad_dtype)):
        if name is not None and not dtypes.is_floating(dtypes.canonical(name)):
            raise YafsdpError(f"{flag} {name!r} is not a floating-point dtype")


def _tuple(values) -> tuple | None:
    return None if values is None else tuple(values)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutOptions:
    """Which parameters become flat buffers, grouped how, aligned how, sharded how far."""

    filters: tuple[str, ...] = ()  # --filter: empty converts every floating parameter
    excludes: tuple[str, ...] = ()  # --exclude
    units: tuple[str, ...] | None = None  # --unit globs; None or empty: the repeated blocks
    world_size: int = 1  # ranks the buffers are sharded for
    align: str = "yafsdp"  # yafsdp | fsdp | megatron | none | BYTES

    def __post_init__(self) -> None:
        # lists from a JSON document or a Typer option hash and compare as tuples
        object.__setattr__(self, "filters", tuple(self.filters))
        object.__setattr__(self, "excludes", tuple(self.excludes))
        object.__setattr__(self, "units", _tuple(self.units))
        for expr in (*self.filters, *self.excludes):
            parse_filter(expr)  # a malformed expression fails before anything loads
        check_at_least("world-size", self.world_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOptions:
    """One training step: its optimizer, its inputs, where it runs, in which dtypes."""

    batch: int = 2  # samples per micro-batch
    seq_len: int | None = 16  # tokens per sample; None: the model's context length
    # micro-batches per optimizer step (gradient accumulation): each a forward and a
    # backward, the gradients held from the first backward on, then one optimizer step
    grad_accum: int = 1
    input_shape: tuple[int, ...] | None = None  # None: from the model kind
    seed: int = 0  # of the inputs and the loss
    device: str = "cpu"  # cpu | cuda: where the step runs
    target: str | None = None  # cpu | cuda: whose kernels are accounted; None: the device's
    checkpointing: str = "none"  # none | reentrant | non-reentrant | selective:op|layer=N
    param_dtype: str | None = None  # training dtype of floating parameters; None: as stored
    grad_dtype: str | None = None  # None: the parameter's dtype
    # fine-tuning (see options/finetune.py): what does not train, and the LoRA adapter
    freeze: tuple[str, ...] = ()  # --freeze filter expressions: no gradient, no state
    lora: str | None = None  # --lora r=16,alpha=32,targets=q_proj,v_proj; None: none
    quantize: str | None = None  # --quantize nf4|nf4-dq|fp4|fp4-dq|int8: the frozen linears
    # last, as the memory model's inputs list them (``check``'s report, a baseline)
    optimizer: str | None = "adamw"  # adamw | adam | sgd | none; None: a checkpoint's own
    optimizer_impl: str = "auto"  # auto | for-loop | foreach | fused
    # model | ce | fused-ce | chunked-ce[:N] | projection (engine/losses.py); None: the model's own
    # loss where it computes one, else projection
    loss: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", _tuple(self.input_shape))
        object.__setattr__(self, "freeze", tuple(self.freeze))
        for expr in self.freeze:
            parse_filter(expr)  # a malformed expression fails before anything loads
        if self.lora is not None:
            parse_lora(self.lora)
        check_quantize(self.quantize)
        check_optimizer(self.optimizer or "adamw", self.optimizer_impl)
        check_at_least("batch", self.batch)
        check_at_least("grad-accum", self.grad_accum, maximum=MAX_GRAD_ACCUM)
        check_at_least("seq-len", self.seq_len, maximum=MAX_SEQ_LEN)
        checked(self.seed, "--seed", 0, MAX_SEED, whole=True)
        if self.input_shape is not None:
            if not self.input_shape:
                raise YafsdpError("--input-shape is empty; give positive integers like 2,3,32,32")
            elements = 1
            for size in self.input_shape:
                elements *= checked(size, "--input-shape", 1, MAX_SEQ_LEN, whole=True)
            if elements > MAX_COUNT * MAX_SEQ_LEN:  # as many as the largest batch of tokens
                raise YafsdpError(
                    f"--input-shape {self.input_shape} holds {elements:,} elements, more "
                    f"than {MAX_COUNT * MAX_SEQ_LEN:,}"
                )
        check_device("--device", self.device)
        if self.target is not None:
            check_device("--target", self.target)
        check_checkpointing(self.checkpointing)
        parse_loss(self.loss)
        check_training_dtypes(self.param_dtype, self.grad_dtype)

    @property
    def kernels(self) -> str:
        """The device whose kernels the figures are for."""
        return self.target or self.device


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryOptions:
    """What the memory model and the fit test take beyond the layout and the step: the
    GPU, what is held outside PyTorch's allocator, and how the allocator counts.

    A new input of the memory model (an allocator configuration, a safety margin,
    overheads per part) is a field here, checked in ``__post_init__``; every command
    whose options hold this piece then carries it, and ``memory.config.memory_config``
    hands the piece to the memory model."""

    gpu_memory: int | None = None  # bytes per GPU; None: no GPU to fit (inspect, profile)
    # bytes held beside the allocator per GPU, all parts at once; None: itemised
    # (memory.outside_allocator), each part overridable through ``outside``
    reserve: int | None = None
    outside: tuple[tuple[str, int], ...] = ()  # (part, bytes): context, cublas, cublaslt, nccl
    margin: int | None = None  # bytes the best plan keeps free; None: DEFAULT_MARGIN of the GPU
    master_weights: bool | None = None  # float32 masters; None: on for 16-bit parameters
    round_bytes: int | None = None  # allocator rounding; None: ``rounding``'s rule
    fsdp_placement: str = "dim0"  # what the FSDP2 column models: dim0 | auto
    alloc_conf: str | None = None  # the allocator replay's settings; None: PYTORCH_CUDA_ALLOC_CONF

    def __post_init__(self) -> None:
        for flag, value in (
            ("--gpu-memory", self.gpu_memory),
            ("--reserve", self.reserve),
            ("--margin", self.margin),
        ):
            if value is not None:
                checked(value, f"{flag} (bytes)", 0, MAX_BYTES, whole=True)
        if self.gpu_memory is not None:
            if self.gpu_memory <= 0:
                raise YafsdpError(f"--gpu-memory must be positive, got {self.gpu_memory} bytes")
            for flag, value in (("--reserve", self.reserve), ("--margin", self.margin)):
                if value is not None and not 0 <= value < self.gpu_memory:
                    raise YafsdpError(
                        f"{flag} {value} bytes must be at least 0 and below --gpu-memory "
                        f"({self.gpu_memory} bytes)"
                    )
        for part, value in self.outside:
            if part not in OUTSIDE_PARTS or problem(value, 0, MAX_BYTES, whole=True):
                raise YafsdpError(
                    f"--outside {shown(part)}={shown(value)}: give bytes of at least 0 "
                    f"(at most 1 EiB) for any of {', '.join(OUTSIDE_PARTS)}"
                )
        object.__setattr__(self, "outside", tuple((str(k), int(v)) for k, v in self.outside))
        check_at_least("round-bytes", self.round_bytes, maximum=MAX_ROUND_BYTES)
        check_placement(self.fsdp_placement)
        if self.alloc_conf is not None:
            parse_alloc_conf(self.alloc_conf, ALLOC_CONF_FLAG)  # fails before any step runs

    def rounding(self, kernels: str) -> int:
        """Every storage's rounding for a step of ``kernels`` (``StepOptions.kernels``):
        ``round_bytes`` where given (``--round-bytes``), else 512 B for CUDA's kernels
        (its caching allocator) and 1 B for the CPU's. Plan, profile and check's fake
        step all ask this, so one cell reads the same bytes in each."""
        if self.round_bytes is not None:
            return self.round_bytes
        return CUDA_ROUND_BYTES if kernels == "cuda" else 1

    @property
    def margin_bytes(self) -> int:
        """``margin``, or ``DEFAULT_MARGIN`` of ``gpu_memory`` (0 without a GPU)."""
        if self.margin is not None:
            return self.margin
        return round(DEFAULT_MARGIN * (self.gpu_memory or 0))
