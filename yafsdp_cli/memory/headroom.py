"""Will it fit: the per-rank budget arithmetic, in one place.

A GPU fits a rank when the rank's peak in PyTorch's allocator (for ``plan``, the
caching allocator's predicted reserved peak) plus what is held beside it (``reserve``:
the CUDA context, cuBLAS workspaces and NCCL's buffers, ``outside_allocator``) is at
most the GPU's memory; ``headroom`` is what is left then (negative: short by that
much). A host
fits ``verify`` when its processes' sum, each rank's peak plus a fixed margin, is
at most what the host has available. ``plan`` (``planning.fit_grid``, for the
memory model's persistent bytes and for each configuration's peak) and ``verify``
(``verify.budget``) read these, so they answer "does it fit" alike.
"""

from __future__ import annotations


def needed_bytes(peak: int, reserve: int) -> int:
    """What one GPU must have for a rank of ``peak`` bytes in the allocator."""
    return peak + reserve


def headroom(peak: int, reserve: int, capacity: int) -> int:
    """Bytes left on ``capacity`` (negative: missing) with the rank at ``peak``."""
    return capacity - needed_bytes(peak, reserve)


def fits(peak: int, reserve: int, capacity: int) -> bool:
    return headroom(peak, reserve, capacity) >= 0


def keeps_margin(needed: int, capacity: int, margin: int) -> bool:
    """``needed`` fits ``capacity`` with ``margin`` bytes still free: what a
    recommended configuration must do, beyond fitting."""
    return capacity - needed >= margin


def process_sum(per_rank: int, ranks: int, margin: int) -> int:
    """Host memory of ``ranks`` processes that each hold ``per_rank`` bytes plus
    ``margin`` (allocator slack, tensors read back)."""
    return ranks * (per_rank + margin)
