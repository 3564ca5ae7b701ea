"""What ``plan`` is asked: its options, checked once, and the parsing of sizes and lists."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import dtypes
from ..engine.idioms import check_checkpointing
from ..errors import YafsdpError
from ..memory import MemoryConfig
from ..profiling.precision import check_training_dtypes

GiB = 1024**3
MAX_WORLD_SIZE = 512
CHECKPOINTING = ("none", "non-reentrant")  # the default choices; "reentrant" too
# CUDA context + NCCL, held outside PyTorch's allocator on every rank (see
# docs/plan.md: the CUDA context of torch 2.x on an H100/H200 takes about 0.5 GiB,
# NCCL's communicators and their buffers about 1 GiB more at these world sizes).
DEFAULT_RESERVE = 2 * GiB
ROUND_BYTES = 512  # the CUDA caching allocator hands out multiples of 512 bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    gpu_memory: int  # bytes per GPU
    world_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to what is needed
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    checkpointing: tuple[str, ...] = CHECKPOINTING
    seq_len: int | None = None  # None: the model's context length, else 2048
    reserve: int = DEFAULT_RESERVE
    param_dtype: str | None = "bfloat16"
    grad_dtype: str | None = None
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"  # torch's default for CUDA tensors
    filters: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    units: tuple[str, ...] | None = None
    align: str = "yafsdp"
    round_bytes: int = ROUND_BYTES
    target: str = "cuda"  # whose kernels the fake steps account (see profile --target)
    jobs: int | None = None  # fake runs at once (processes); None: cores and memory allow
    seed: int = 0

    def __post_init__(self) -> None:
        if self.gpu_memory <= 0:
            raise YafsdpError(f"--gpu-memory must be positive, got {self.gpu_memory} bytes")
        if self.reserve < 0 or self.reserve >= self.gpu_memory:
            raise YafsdpError(
                f"--reserve {self.reserve} bytes must be at least 0 and below --gpu-memory "
                f"({self.gpu_memory} bytes)"
            )
        for flag, values in (("world-size", self.world_sizes), ("micro-batch", self.micro_batches)):
            if values is not None and (not values or min(values) < 1):
                raise YafsdpError(f"--{flag} needs numbers of at least 1, got {values}")
        if not self.checkpointing:
            raise YafsdpError("--checkpointing needs at least one of none|reentrant|non-reentrant")
        for mode in self.checkpointing:
            check_checkpointing(mode)
        if self.jobs is not None and self.jobs < 1:
            raise YafsdpError(f"--jobs must be at least 1, got {self.jobs}")
        if self.target not in ("cpu", "cuda"):
            raise YafsdpError(f"--target {self.target!r} is not cpu or cuda")
        if self.seq_len is not None and self.seq_len < 1:
            raise YafsdpError(f"--seq-len must be at least 1, got {self.seq_len}")
        check_training_dtypes(self.param_dtype, self.grad_dtype)
        if self.param_dtype is not None:
            object.__setattr__(self, "param_dtype", dtypes.canonical(self.param_dtype))

    def memory_config(self) -> MemoryConfig:
        return MemoryConfig(
            grad_dtype=self.grad_dtype, optimizer=self.optimizer, round_bytes=self.round_bytes
        )


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str, flag: str) -> int:
    """``"80GiB"`` -> bytes. K/M/G/T and KiB..TiB are powers of 1024, KB..TB of 1000."""
    s = text.strip().replace(" ", "").lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value < 0:
        raise YafsdpError(f"{flag} {text!r} is not a size; write it like 80GiB, 2GiB or 512MiB")
    return int(value * _SIZE_UNITS[unit])


def parse_ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"1,2,4"`` -> ``(1, 2, 4)``; None stays None."""
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise YafsdpError(
            f"{flag} {text!r}: give positive integers separated by commas, e.g. 1,2,4"
        )
    return tuple(dict.fromkeys(values))
