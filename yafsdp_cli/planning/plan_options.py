"""What ``plan`` is asked: its options (the layout, step and memory pieces and its
grid), the parsing of lists, and what a GPU size given in GB really is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.choices import check_checkpointing
from ..errors import YafsdpError
from ..memory import MemoryConfig
from ..memory.config import memory_config
from ..options import (
    DEFAULT_RESERVE,
    DEFAULT_TRAINING_DTYPE,
    Composed,
    LayoutOptions,
    MemoryOptions,
    StepOptions,
    check_at_least,
)
from ..options.sizes import parse_size, si_echo
from ..timing.gpu_specs import GIB, GPUS, MIB

MAX_WORLD_SIZE = 512
CHECKPOINTING = ("none", "non-reentrant")  # the default choices; "reentrant" too
ROUND_BYTES = 512  # the CUDA caching allocator hands out multiples of 512 bytes


@dataclass(frozen=True, kw_only=True, slots=True, init=False)
class PlanOptions(Composed):
    """``gpu_memory`` (bytes per GPU) is required; ``world_sizes`` None: 1, 2, 4, ...
    up to what is needed; ``seq_len`` None: the model's context length, else 2048;
    ``target``: whose kernels the fake steps account (see profile --target)."""

    FIELDS = (
        "gpu_memory",
        "world_sizes",
        "micro_batches",
        "checkpointing",
        "seq_len",
        "reserve",
        "param_dtype",
        "grad_dtype",
        "optimizer",
        "optimizer_impl",
        "filters",
        "excludes",
        "units",
        "align",
        "round_bytes",
        "target",
        "jobs",
        "seed",
    )
    DEFAULTS = {
        "seq_len": None,
        "param_dtype": DEFAULT_TRAINING_DTYPE,
        "optimizer_impl": "foreach",  # torch's default for CUDA tensors
        "target": "cuda",
        "reserve": DEFAULT_RESERVE,
        "round_bytes": ROUND_BYTES,
    }

    layout: LayoutOptions
    step: StepOptions
    memory: MemoryOptions
    world_sizes: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    checkpointing: tuple[str, ...] = CHECKPOINTING  # the grid's; the step piece's is unused
    jobs: int | None = None  # fake runs at once (processes); None: cores and memory allow

    def __post_init__(self) -> None:
        if self.memory.gpu_memory is None:
            raise YafsdpError("give --gpu-memory, the memory of one GPU, e.g. 80GiB")
        for flag, values in (("world-size", self.world_sizes), ("micro-batch", self.micro_batches)):
            if values is not None and (not values or min(values) < 1):
                raise YafsdpError(f"--{flag} needs numbers of at least 1, got {values}")
        if not self.checkpointing:
            raise YafsdpError("--checkpointing needs at least one of none|reentrant|non-reentrant")
        for mode in self.checkpointing:
            check_checkpointing(mode)
        check_at_least("jobs", self.jobs)
        if self.step.param_dtype is not None:  # the report names it in full
            step = dataclasses.replace(self.step, param_dtype=dtypes.canonical(self.param_dtype))
            object.__setattr__(self, "step", step)

    def memory_config(self) -> MemoryConfig:
        return memory_config(self.step, self.memory)


def gpu_memory_notes(text: str) -> tuple[str, ...]:
    """What ``--gpu-memory`` given in SI units (``80GB``) is in GiB and, where GPUs
    sold as that many GB are in ``timing.gpu_specs``, what they really hold: the box
    says "80 GB" of a GPU whose driver reports 81,559 MiB (79.65 GiB), so ``80GB``
    (74.51 GiB) understates it by 5 GiB, enough to turn a fit into an OOM."""
    echo = si_echo(text, "--gpu-memory")
    if echo is None:
        return ()
    sold_as = parse_size(text, "--gpu-memory") / 10**9  # the number on the box
    near: dict[int, str] = {}  # one name per figure: the H100 SXM and PCIe hold the same
    for g in GPUS.values():
        if abs(g.memory_bytes / GIB - sold_as) <= 0.1 * sold_as:
            near.setdefault(g.memory_bytes, g.name)
    if not near:
        return (echo,)
    held = ", ".join(f"{name} {b // MIB:,} MiB ({b / GIB:.2f} GiB)" for b, name in near.items())
    first = min(near)
    hint = (
        f"GPUs sold as {sold_as:g} GB hold {held}; give what nvidia-smi reports, "
        f"e.g. --gpu-memory {first // MIB}MiB"
    )
    return (echo, hint)


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
