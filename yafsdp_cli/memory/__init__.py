"""The per-rank memory model: what each rank holds under each scheme.

Owns the bytes of parameters, gradients, optimizer states and communication
buffers per rank for DDP, ZeRO-2/3, FSDP and the flat layout (``model``), computed
from a ``Layout`` and a ``MemoryConfig`` with no torch. It may import ``engine``,
``errors`` and ``fileio``; inspect, verify, profiling and the gate import it.
"""

from .model import MemoryBreakdown, MemoryConfig, MemoryReport, assumptions, estimate_memory

__all__ = ["MemoryBreakdown", "MemoryConfig", "MemoryReport", "assumptions", "estimate_memory"]
