"""Reserved memory: a step's allocation trace replayed through a model of PyTorch's
CUDA caching allocator.

A step's peak of *allocated* bytes is what its tensors hold; a GPU runs out of
*reserved* bytes, what the caching allocator has taken from the driver. The two
differ by rounding, by the segments requests are carved from, and by free blocks
that no later request fits. ``reserved_of`` replays an ordered trace of
allocations and frees (``AllocTrace``) through the allocator's rules, as
``c10/cuda/CUDACachingAllocator.cpp`` states them:

>>> trace = AllocTrace.from_pairs([(0, 3 << 20), (0, None), (1, 30 << 20)])
>>> est = reserved_of(trace)  # a 3 MiB request carves a 20 MiB segment, then 30 MiB
>>> est.reserved_peak == (20 + 30) << 20, est.segments
(True, 2)

[Note: the allocator's rules, as modelled]
- Sizes round up to 512 B, or to a power-of-two division (``roundup_power2_divisions``).
- Requests of at most 1 MiB use the small pool, whose segments are 2 MiB; larger
  ones the large pool: under 10 MiB a 20 MiB segment, else the size rounded up to
  2 MiB. Pools are per stream: a freed block serves only its own stream.
- A request takes the smallest cached block of its pool and stream that is large
  enough (best fit, ties by address); a block of ``max_split_size`` or more never
  serves a smaller request, and serves an oversize request only if it is smaller
  than the request plus ``max_non_split_rounding``.
- The block taken is split when the rest is worth keeping: at least 512 B in the
  small pool (or with expandable segments), more than 1 MiB in the large pool, and
  never for an oversize request. The request takes the block's front.
- A freed block merges with free neighbours of its segment.
- No cached fit: garbage collection (with a capacity and a threshold), then a new
  segment; at the capacity, oversize cached blocks are released, then every wholly
  free segment (``release_cached_blocks``), and the request retried; only then OOM.
- Expandable segments: one growing segment per pool and stream, mapped in pages
  (2 MiB small, 20 MiB large); a new request maps pages at the lowest free address
  that has room, merging with a free block before it; releasing cache unmaps the
  whole free pages of free blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import YafsdpError
from ..options.alloc_conf import LARGE_BUFFER, MIB, AllocatorConf, parse_alloc_conf
from .alloc_segments import Allocator, OutOfMemoryError


class TraceEvent(NamedTuple):
    """One allocator call: ``size > 0`` allocates ``block`` (an id unique in its
    trace), ``size == 0`` frees it. ``stream``: the stream it is allocated on."""

    block: int
    size: int
    stream: int = 0


@dataclass(frozen=True, slots=True)
class AllocTrace:
    """A step's allocations and frees, in order. ``step_start``: how many events come
    before the step proper (the state the step starts from: parameters, optimizer
    state, the batch)."""

    events: tuple[TraceEvent, ...]
    step_start: int = 0

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int | None]]) -> AllocTrace:
        """``(id, size)`` allocates, ``(id, None)`` frees; stream 0. For hand-written
        traces."""
        return cls(tuple(TraceEvent(i, 0 if s is None else s) for i, s in pairs))


@dataclass(frozen=True, slots=True)
class ReservedEstimate:
    """A replay's outcome, in bytes. ``allocated`` counts the blocks handed out (as
    ``torch.cuda.memory_allocated`` does: a block taken whole counts whole)."""

    conf: str  # the settings, in PYTORCH_CUDA_ALLOC_CONF syntax ("default": none)
    reserved_peak: int  # max bytes held from the driver (torch.cuda.max_memory_reserved)
    allocated_at_peak: int  # allocated just after the event that set reserved_peak
    fragmentation: int  # reserved_peak - allocated_at_peak
    allocated_peak: int  # torch.cuda.max_memory_allocated
    requested_peak: int  # max of the requests' own bytes (before rounding to blocks)
    segments: int  # segments alive at the reserved peak (expandable: mapped pages' segments)
    segments_created: int  # cudaMalloc calls, or page mappings with expandable segments
    cache_releases: int  # times a capacity forced cached blocks back to the driver
    capacity: int | None  # bytes the allocator may reserve; None: no limit
    oom_event: int | None  # index of the event that ran out of memory; None: it fits
    events: int  # events replayed

    @property
    def fits(self) -> bool | None:
        """True/False against ``capacity``; None without one."""
        return None if self.capacity is None else self.oom_event is None


def reserved_of(
    trace: AllocTrace | Sequence[TraceEvent],
    conf: AllocatorConf | str | None = None,
    *,
    capacity: int | None = None,
) -> ReservedEstimate:
    """Replay ``trace`` under ``conf`` (an ``AllocatorConf`` or
    ``PYTORCH_CUDA_ALLOC_CONF`` text); with ``capacity`` (bytes), also whether it
    fits. The replay stops at the first event that runs out of memory."""
    if not isinstance(conf, AllocatorConf):
        conf = parse_alloc_conf(conf)
    if capacity is not None and capacity < 0:
        raise YafsdpError(f"capacity must not be negative, got {capacity}")
    events = trace.events if isinstance(trace, AllocTrace) else tuple(trace)
    alloc = Allocator(conf, capacity)
    live: dict[int, object] = {}
    malloc, free = alloc.malloc, alloc.free
    requested = requested_peak = reserved_peak = at_peak = allocated_peak = segments = 0
    oom = None
    # one loop with the peaks kept in locals: this runs once per event of a 70B step
    for n, (block, size, stream) in enumerate(events):
        if size > 0:
            if block in live:
                raise YafsdpError(f"trace event {n}: block {block} is allocated twice")
            try:
                live[block] = malloc(size, stream)
            except OutOfMemoryError:
                oom = n
                break
            requested += size
            requested_peak = max(requested_peak, requested)
            allocated_peak = max(allocated_peak, alloc.allocated)
            if alloc.reserved > reserved_peak:
                reserved_peak, at_peak, segments = alloc.reserved, alloc.allocated, alloc.segments
        else:
            handle = live.pop(block, None)
            if handle is None:
                raise YafsdpError(f"trace event {n}: block {block} is freed but not allocated")
            requested -= handle.requested
            free(handle)
    return ReservedEstimate(
        conf=str(conf),
        reserved_peak=reserved_peak,
        allocated_at_peak=at_peak,
        fragmentation=reserved_peak - at_peak,
        allocated_peak=allocated_peak,
        requested_peak=requested_peak,
        segments=segments,
        segments_created=alloc.segments_created,
        cache_releases=alloc.cache_releases,
        capacity=capacity,
        oom_event=oom,
        events=len(events),
    )


def first_fit(
    trace: AllocTrace, capacity: int, confs: Iterable[AllocatorConf | str]
) -> ReservedEstimate | None:
    """The first of ``confs`` under which ``trace`` fits ``capacity`` bytes, as its
    estimate; None if none does."""
    for conf in confs:
        est = reserved_of(trace, conf, capacity=capacity)
        if est.fits:
            return est
    return None


__all__ = [
    "LARGE_BUFFER",
    "MIB",
    "AllocTrace",
    "ReservedEstimate",
    "TraceEvent",
    "first_fit",
    "reserved_of",
]
