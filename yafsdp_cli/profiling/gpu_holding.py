"""What a GPU must hold for a profiled step: the caching allocator's reserve and the
memory beside it (``--target cuda``).

The step's allocation trace (``StorageTracker.alloc_trace``) is replayed through the
allocator's model (``memory.caching_allocator.reserved_of``) under the settings the
training process would have: ``--alloc-conf``, else ``PYTORCH_CUDA_ALLOC_CONF`` from
the environment. The memory beside it (``memory.outside_allocator``) is for the
installed torch, the GPU profiled on (Hopper when the GPU is substituted) and the
variables in the environment. The replay costs well under 1% of a fake step
(``benchmarks/gpu/reserved-h200.log``: 0.003-0.23 s against 1.7-5.5 s).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..memory.caching_allocator import AllocTrace, reserved_of
from ..memory.outside_allocator import HOPPER, OutsideAllocator, outside_memory
from ..options.alloc_conf import AllocatorConf, allocator_setting
from .profile_options import ProfileOptions
from .profile_report import ReservedPeak


@dataclass(frozen=True, slots=True)
class GpuHolding:
    """The replay's settings and the memory beside the allocator, once per profile."""

    conf: AllocatorConf
    outside: OutsideAllocator


def gpu_holding(opts: ProfileOptions) -> GpuHolding | None:
    """``None`` unless the figures are CUDA's (``--target cuda``); a bad setting or
    variable is a ``YafsdpError`` before any step runs."""
    if opts.kernels != "cuda":
        return None
    conf = allocator_setting(opts.memory.alloc_conf)  # a bad one fails before the context is read
    on_gpu = opts.step.device == "cuda" and torch.cuda.is_available()
    capability = tuple(torch.cuda.get_device_capability()) if on_gpu else HOPPER
    outside = outside_memory(
        torch_version=torch.__version__,
        world_size=opts.layout.world_size,
        capability=capability,
        env=os.environ,
    )
    return GpuHolding(conf, outside)


def reserved_peak(trace: AllocTrace, holding: GpuHolding) -> ReservedPeak:
    est = reserved_of(trace, holding.conf)
    outside = holding.outside.total
    return ReservedPeak(
        alloc_conf=est.conf,
        reserved_peak=est.reserved_peak,
        allocated_at_peak=est.allocated_at_peak,
        fragmentation=est.fragmentation,
        outside_bytes=outside,
        gpu_bytes=est.reserved_peak + outside,
    )
