"""What ``plan`` is asked: its options (the layout, step and memory pieces and its
grid), the parsing of lists, and what a GPU size given in GB really is."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..engine import dtypes
from ..engine.choices import CHECKPOINTING as CHOICES
from ..engine.choices import check_checkpointing
from ..errors import YafsdpError
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
    LayoutOptions,
    MemoryOptions,
    StepOptions,
)
from ..schemes import FLAT
from ..schemes import check_names as check_schemes

if TYPE_CHECKING:
    from ..timing.gpu_profile import GpuProfile

MAX_WORLD_SIZE = 512
CHECKPOINTING = ("none", "non-reentrant")  # the default choices; "reentrant" too


# plan's own defaults of the pieces: the model's context length, bf16 with float32
# masters, torch's optimizer for CUDA tensors, CUDA's kernels (and so, by the memory
# piece's rule, the caching allocator's 512-byte rounding; 1 B with --target cpu)
PLAN_STEP = StepOptions(
    seq_len=None, param_dtype=DEFAULT_TRAINING_DTYPE, optimizer_impl="foreach", target="cuda"
)
PLAN_MEMORY = MemoryOptions()


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """``memory.gpu_memory`` (bytes per GPU) is required unless a GPU is named;
    ``world_sizes`` None: 1, 2, 4, ... up to what is needed; ``step.seq_len`` None: the
    model's context length, else 2048; ``step.target``: whose kernels the fake steps
    account (see profile --target); ``step.grad_accum``: the micro-batches every cell's
    step runs before its optimizer step. The step piece's batch and checkpointing are
    the grid's (``micro_batches``, ``checkpointing``), its world size ``world_sizes``."""

    layout: LayoutOptions = LayoutOptions()
    step: StepOptions = PLAN_STEP
    memory: MemoryOptions = PLAN_MEMORY
    world_sizes: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    checkpointing: tuple[str, ...] = CHECKPOINTING  # the grid's; the step piece's is unused
    jobs: int | None = None  # fake runs at once (processes); None: cores and memory allow
    schemes: tuple[str, ...] = (FLAT.name,)  # schemes.SCHEMES to compare, by name
    # the step-time model's inputs (``cell_time``); a named GPU sets ``gpu_memory``
    # where it is not given
    gpu: str | None = None  # a GPU of ``timing.GPUS``, any case
    gpu_profile: str | None = None  # a JSON GPU profile (``schemas/gpu.schema.json``)
    # ``gpu_profile`` as read, once, when the options are made (what ``cell_time`` times
    # with); a saved plan records the file's path and reads it again
    profile: GpuProfile | None = field(default=None, compare=False, repr=False)
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
            raise YafsdpError(f"--checkpointing needs at least one of {'|'.join(CHOICES)}")
        for mode in self.checkpointing:
            check_checkpointing(mode)
        if self.jobs is not None:
            checked(self.jobs, "--jobs", 1, MAX_JOBS, whole=True)
        object.__setattr__(self, "schemes", check_schemes(self.schemes))
        if self.step.param_dtype is not None:  # the report names it in full
            step = dataclasses.replace(
                self.step, param_dtype=dtypes.canonical(self.step.param_dtype)
            )
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
        if self.gpu_profile is not None and self.profile is None:
            object.__setattr__(self, "profile", load_profile(self.gpu_profile))
        gpu = gpu_spec(self.gpu) if self.gpu else self.profile.gpu
        if self.memory.gpu_memory is None:
            memory = dataclasses.replace(self.memory, gpu_memory=gpu.memory_bytes)
            object.__setattr__(self, "memory", memory)

    def memory_config(self) -> MemoryConfig:
        return memory_config(self.step, self.memory)

    @property
    def round_bytes(self) -> int:
        """Every storage's rounding: ``--round-bytes``, else the target's
        (``MemoryOptions.rounding``: 512 B for CUDA's kernels, 1 B for the CPU's)."""
        return self.memory.rounding(self.step.kernels)

    def recorded(self) -> dict[str, Any]:
        """What a saved plan records (``SAVED``, in its order): the pieces' fields and
        the plan's own, read from the dataclasses' fields; the grid's checkpointing
        stands for the step piece's."""
        values = {f.name: getattr(p, f.name) for p in self._pieces() for f in fields(p)}
        values.update((name, getattr(self, name)) for name in _own_fields())
        return {name: values[name] for name in SAVED}

    @classmethod
    def from_recorded(cls, doc: Mapping[str, Any]) -> PlanOptions:
        """The options ``recorded`` wrote, each name to the piece whose field it is
        (the plan's own fields first); a name of no field is a ``TypeError``."""
        own = _own_fields()
        given = {"layout": LayoutOptions, "step": StepOptions, "memory": MemoryOptions}
        base = {"layout": LayoutOptions(), "step": PLAN_STEP, "memory": PLAN_MEMORY}
        pieces = {}
        for name, kind in given.items():
            names = {f.name for f in fields(kind)} - set(own)
            pieces[name] = dataclasses.replace(
                base[name], **{k: v for k, v in doc.items() if k in names}
            )
        known = set(own).union(*({f.name for f in fields(k)} for k in given.values()))
        unknown = sorted(set(doc) - known)
        if unknown:
            raise TypeError(f"PlanOptions has no option {', '.join(unknown)}")
        return cls(**pieces, **{k: v for k, v in doc.items() if k in own})

    def _pieces(self) -> tuple[LayoutOptions, StepOptions, MemoryOptions]:
        return self.layout, self.step, self.memory


def _own_fields() -> tuple[str, ...]:
    """PlanOptions' own fields: not a piece, not the profile read from a file."""
    skip = {"layout", "step", "memory", "profile"}
    return tuple(f.name for f in fields(PlanOptions) if f.name not in skip)


# The saved plan's ``options`` object (``yafsdp.plan/1``), in the document's order:
# names of the pieces' and PlanOptions' fields (``tests/options`` holds them to it).
# The layout's world size, the step's batch, input shape and device, and the memory
# piece's master weights and FSDP2 placement are not the plan's to choose.
SAVED = (
    "gpu_memory",
    "world_sizes",
    "micro_batches",
    "grad_accum",
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
    "loss",
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
