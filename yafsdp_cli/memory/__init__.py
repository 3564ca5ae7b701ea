"""The per-rank memory model: what each rank holds under each scheme.

Owns the bytes of parameters, gradients, optimizer states and communication
buffers per rank for DDP, ZeRO-2/3 and the flat layout (``estimate``), and FSDP2's
per-parameter placement rank by rank (``fsdp2``), computed from a ``Layout`` and
a ``MemoryConfig`` (``config``) with no torch; what each training scheme (flat,
FSDP2, ZeRO-1/2/3, DDP) holds through a step besides activations, its gathered
parameters and gradient buffers included (``step_schemes``); and what PyTorch's CUDA caching
allocator reserves for a step's allocation trace (``caching_allocator``, its
settings in ``alloc_conf``, its block bookkeeping in ``alloc_segments``), and what a
GPU holds beside it (``outside_allocator``: the CUDA context, cuBLAS workspaces,
NCCL buffers). It may import ``engine``, ``options``, ``schemes``, ``errors`` and
``fileio``; inspect, verify, profiling and the gate import it.
"""

from ..options.alloc_conf import AllocatorConf, parse_alloc_conf
from .caching_allocator import AllocTrace, ReservedEstimate, TraceEvent, first_fit, reserved_of
from .config import MemoryBreakdown, MemoryConfig
from .estimate import MemoryReport, assumptions, estimate_memory
from .fsdp2 import Fsdp2Memory, RankGroup, UnevenSplit, persistent_by_rank, rank_groups
from .outside_allocator import OutsideAllocator, OutsidePart, outside_memory

__all__ = [
    "AllocTrace",
    "AllocatorConf",
    "ReservedEstimate",
    "TraceEvent",
    "first_fit",
    "OutsideAllocator",
    "OutsidePart",
    "outside_memory",
    "parse_alloc_conf",
    "reserved_of",
    "Fsdp2Memory",
    "MemoryBreakdown",
    "MemoryConfig",
    "MemoryReport",
    "RankGroup",
    "UnevenSplit",
    "assumptions",
    "estimate_memory",
    "persistent_by_rank",
    "rank_groups",
]
