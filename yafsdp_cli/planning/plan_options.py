"""What ``plan`` is asked: its options (the layout, step and memory pieces and its
grid), the parsing of lists, and what a GPU size given in GB really is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.choices import check_checkpointing
from ..errors import YafsdpError
from ..gpu_table import GIB, MIB
from ..memory import MemoryConfig
from ..memory.config import memory_config
from ..numbers import (
    MAX_BYTES_PER_S,
    MAX_COUNT,
    MAX_JOBS,
    MAX_TOKENS,
    MIN_RATE,
    checked,
    from_text,
    problem,
    shown,
)
from ..options import (
    DEFAULT_TRAINING_DTYPE,
    OUTSIDE_PARTS,
    Composed,
    LayoutOptions,
    MemoryOptions,
    StepOptions,
)
from ..options.sizes import parse_size, si_echo
from ..schemes import FLAT
from ..schemes import check_names as check_schemes
from ..timing.gpu_specs import GPUS

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
        "outside",
        "margin",
        "alloc_conf",
        "param_dtype",
        "grad_dtype",
        "freeze",
        "lora",
        "quantize",
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
        "schemes",
        "gpu",
        "gpu_profile",
        "network",
        "objective",
        "tokens",
    )
    DEFAULTS = {
        "seq_len": None,
        "param_dtype": DEFAULT_TRAINING_DTYPE,
        "optimizer_impl": "foreach",  # torch's default for CUDA tensors
        "target": "cuda",
        "round_bytes": ROUND_BYTES,
    }

    layout: LayoutOptions
    step: StepOptions
    memory: MemoryOptions
    world_sizes: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    checkpointing: tuple[str, ...] = CHECKPOINTING  # the grid's; the step piece's is unused
    jobs: int | None = None  # fake runs at once (processes); None: cores and memory allow
    schemes: tuple[str, ...] = (FLAT.name,)  # schemes.SCHEMES to compare, by name
    # the step-time model's inputs (``cell_time``); a named GPU sets ``gpu_memory``
    # where it is not given
    gpu: str | None = None  # a GPU of ``timing.GPUS``, any case
    gpu_profile: str | None = None  # a JSON GPU profile (``schemas/gpu.schema.json``)
    network: float | None = None  # inter-node bytes/s per GPU; None: ``timing.Cluster``'s
    objective: str | None = None  # how the best row is chosen; None: the default objective
    tokens: int | None = None  # tokens to train on, for the GPU-hours

    def __post_init__(self) -> None:
        self._check_timing()
        if self.memory.gpu_memory is None:
            raise YafsdpError(
                "give --gpu-memory, the memory of one GPU, e.g. 80GiB (or --gpu NAME)"
            )
        for flag, values in (("world-size", self.world_sizes), ("micro-batch", self.micro_batches)):
            if values is not None and not values:
                raise YafsdpError(f"--{flag} needs numbers of at least 1, got none")
            for value in values or ():
                checked(value, f"--{flag}", 1, MAX_COUNT, whole=True)
        if not self.checkpointing:
            raise YafsdpError("--checkpointing needs at least one of none|reentrant|non-reentrant")
        for mode in self.checkpointing:
            check_checkpointing(mode)
        if self.jobs is not None:
            checked(self.jobs, "--jobs", 1, MAX_JOBS, whole=True)
        object.__setattr__(self, "schemes", check_schemes(self.schemes))
        if self.step.param_dtype is not None:  # the report names it in full
            step = dataclasses.replace(self.step, param_dtype=dtypes.canonical(self.param_dtype))
            object.__setattr__(self, "step", step)

    def _check_timing(self) -> None:
        """The step-time options, checked before any fake run; a named GPU's memory
        is the plan's ``gpu_memory`` unless that is given."""
        timed = self.gpu is not None or self.gpu_profile is not None
        if self.gpu is not None and self.gpu_profile is not None:
            raise YafsdpError("give --gpu or --gpu-profile, not both")
        for flag, value in (("network", self.network), ("objective", self.objective)):
            if value is not None and not timed:
                raise YafsdpError(
                    f"--{flag} needs the GPU the steps run on: --gpu or --gpu-profile"
                )
        if self.tokens is not None:
            checked(self.tokens, "--tokens", 1, MAX_TOKENS, whole=True)
        if self.network is not None:
            if self.network <= 0:  # the old words for what is no bandwidth at all
                raise YafsdpError(f"--network must be positive, got {shown(self.network)}")
            checked(self.network, "--network (bytes/s)", MIN_RATE, MAX_BYTES_PER_S)
        if not timed:
            return
        from ..timing.gpu_profile import load_profile
        from ..timing.gpu_specs import gpu_spec
        from ..timing.step_estimate import OBJECTIVES

        if self.objective is not None and self.objective not in OBJECTIVES:
            raise YafsdpError(
                f"--objective {self.objective!r} is not one of {'|'.join(OBJECTIVES)}"
            )
        if self.objective == "gpu-hours" and self.tokens is None:
            raise YafsdpError("--objective gpu-hours needs --tokens, the tokens to train on")
        gpu = gpu_spec(self.gpu) if self.gpu else load_profile(self.gpu_profile).gpu
        if self.memory.gpu_memory is None:
            memory = dataclasses.replace(self.memory, gpu_memory=gpu.memory_bytes)
            object.__setattr__(self, "memory", memory)

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
    values = [from_text(v, whole=True) for v in text.replace(" ", "").split(",") if v]
    wrong = [w for w in (problem(v, 1, MAX_COUNT, whole=True) for v in values) if w]
    if not values or wrong:
        why = f" ({wrong[0]})" if wrong else ""
        raise YafsdpError(
            f"{flag} {shown(text)!r}: give positive integers separated by commas, e.g. 1,2,4{why}"
        )
    return tuple(dict.fromkeys(values))


def parse_outside(text: str | None) -> tuple[tuple[str, int], ...]:
    """``"context=1GiB,nccl=0"`` -> ``(("context", 1073741824), ("nccl", 0))``."""
    if not text:
        return ()
    pairs = []
    for item in text.replace(" ", "").split(","):
        part, _, size = item.partition("=")
        if part not in OUTSIDE_PARTS or not size:
            raise YafsdpError(
                f"--outside {item!r}: write PART=SIZE pairs separated by commas, PART one of "
                f"{', '.join(OUTSIDE_PARTS)}, e.g. context=1GiB,nccl=256MiB"
            )
        pairs.append((part, parse_size(size, f"--outside {part}")))
    return tuple(dict(pairs).items())


def parse_margin(text: str | None, gpu_memory: int) -> int | None:
    """``"5%"`` -> 5% of ``gpu_memory`` in bytes; ``"2GiB"`` -> bytes; None stays None."""
    if text is None:
        return None
    s = text.strip()
    if not s.endswith("%"):
        return parse_size(s, "--margin")
    try:
        share = float(s[:-1])
    except ValueError:
        share = -1.0
    if not 0 <= share < 100:
        raise YafsdpError(
            f"--margin {shown(text)!r}: a share is a number from 0 to 100 with %, e.g. 3%"
        )
    return round(share / 100 * gpu_memory)


_RATE_UNITS = {"gb/s": 1e9, "gib/s": 2**30, "mb/s": 1e6, "tb/s": 1e12, "gbit/s": 1e9 / 8}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_rate(text: str | None, flag: str) -> float | None:
    """``"50GB/s"`` -> bytes/s (GB, MB, TB: powers of 1000; GiB/s: of 1024; Gbit/s:
    bits, as NICs are sold: ``400Gbit/s`` is 50 GB/s)."""
    if text is None:
        return None
    s = text.strip().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ/")
    unit = s[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _RATE_UNITS or not value > 0:
        raise YafsdpError(
            f"{flag} {shown(text)!r} is not a bandwidth; write it like 50GB/s or 400Gbit/s"
        )
    rate = value * _RATE_UNITS[unit]
    if not MIN_RATE <= rate <= MAX_BYTES_PER_S:  # inf too: 1e400GB/s
        raise YafsdpError(
            f"{flag} {shown(text)}: a bandwidth is from 1 kB/s to 1 PB/s (1e15 bytes/s)"
        )
    return rate


def parse_count(text: str | None, flag: str) -> int | None:
    """``"2T"`` -> 2 * 10**12 (K, M, B or G, T: thousands to trillions; ``2e12`` too)."""
    if text is None:
        return None
    s = text.strip().replace("_", "").replace(",", "").lower()
    unit = s[-1] if s and s[-1] in "kmbgt" else ""
    try:
        value = float(s[: len(s) - len(unit)]) * _COUNT_UNITS[unit]
    except ValueError:
        value = 0.0
    if not value >= 1:
        raise YafsdpError(f"{flag} {shown(text)!r} is not a count; write it like 2T, 300B or 2e12")
    if not value <= MAX_TOKENS:  # inf too: 1e999
        raise YafsdpError(f"{flag} {shown(text)}: a count is at most 1e18")
    return int(value)
