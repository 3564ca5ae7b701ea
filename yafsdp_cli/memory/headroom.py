"""Will it fit: the per-rank budget arithmetic and its verdict, in one place.

A GPU fits a rank when the rank's peak in PyTorch's allocator (for ``plan``, the
caching allocator's predicted reserved peak) plus what is held beside it (the CUDA
context, cuBLAS workspaces and NCCL's buffers, ``outside_allocator``) is at most the
GPU's memory. ``fit`` is the one place that says so: it gives what the GPU must
have (``needed``), what is left then (``free``; negative: short by that much) and a
verdict, ``fits`` (keeping the asked margin free), ``tight`` (fits, but keeps less
than the margin) or ``over``. ``plan`` (``planning.fit_grid``: the memory model's
persistent bytes; ``planning.reserved_fit`` and ``planning.scheme_peaks``: each
cell) and ``verify`` (``verify.budget``: a host's available memory, no margin) call
it; the rows carry the ``Fit`` and the views (``report``) show its verdict and
figures without comparing any of them again.

A heat map's caller with no margin of its own colours by ``fit_by_share``: tight
above 80% of the GPU. A host fits ``verify`` when its processes' sum, each rank's
peak plus a fixed margin (``process_sum``), is at most what the host has available.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FITS, TIGHT, OVER = "fits", "tight", "over"
SHARE_TIGHT = 0.8  # ``fit_by_share``: above this share of the GPU a cell is tight


@dataclass(frozen=True, slots=True)
class Fit:
    """A rank's verdict on one GPU, with the figures it rests on."""

    needed: int  # what the GPU must have: the peak plus what is held beside the allocator
    free: int  # the GPU's memory minus ``needed`` (negative: short by that much)
    verdict: str  # FITS, TIGHT or OVER

    @property
    def fits(self) -> bool:
        """Fits, inside the margin or not."""
        return self.verdict != OVER

    @property
    def keeps_margin(self) -> bool:
        """Fits with the margin still free: what a recommended configuration must do."""
        return self.verdict == FITS

    @property
    def share(self) -> float:
        """``needed`` as a fraction of the GPU's memory (inf on a GPU of none)."""
        capacity = self.needed + self.free
        return self.needed / capacity if capacity else math.inf


def needed_bytes(peak: int, reserve: int) -> int:
    """What one GPU must have for a rank of ``peak`` bytes in the allocator."""
    return peak + reserve


def fit(peak: int, outside: int, gpu: int, margin: int) -> Fit:
    """A rank of ``peak`` bytes in the allocator and ``outside`` bytes beside it on a
    GPU of ``gpu`` bytes: over when it needs more; tight when it fits with less than
    ``margin`` bytes free; else fits."""
    needed = needed_bytes(peak, outside)
    free = gpu - needed
    return Fit(needed, free, OVER if free < 0 else TIGHT if free < margin else FITS)


def fit_by_share(needed: int, gpu: int) -> Fit:
    """``needed`` bytes on ``gpu`` with no margin asked: fits up to ``SHARE_TIGHT`` of
    the GPU, tight up to all of it, over above."""
    share = needed / gpu if gpu else math.inf
    verdict = FITS if share <= SHARE_TIGHT else TIGHT if share <= 1.0 else OVER
    return Fit(needed, gpu - needed, verdict)


def process_sum(per_rank: int, ranks: int, margin: int) -> int:
    """Host memory of ``ranks`` processes that each hold ``per_rank`` bytes plus
    ``margin`` (allocator slack, tensors read back)."""
    return ranks * (per_rank + margin)
