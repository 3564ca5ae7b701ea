"""What ``profile`` is asked: its options, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.idioms import check_checkpointing
from ..engine.train_step import check_optimizer
from ..errors import YafsdpError
from ..memory.alloc_conf import parse_alloc_conf
from .precision import check_training_dtypes

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
    alloc_conf: str | None = None  # the replay's allocator settings; None: PYTORCH_CUDA_ALLOC_CONF

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
        if self.alloc_conf is not None:
            parse_alloc_conf(self.alloc_conf)  # a bad setting fails before the step runs
        if self.round_bytes is not None and self.round_bytes < 1:
            raise YafsdpError(f"--round-bytes must be at least 1, got {self.round_bytes}")

    @property
    def kernels(self) -> str:
        """The device whose kernels the figures are for."""
        return self.target or self.device
