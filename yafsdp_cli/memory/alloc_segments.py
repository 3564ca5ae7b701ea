"""The caching allocator's state: segments split into blocks, and per-pool free lists.

``caching_allocator`` drives this with a trace and states the rules it follows (see
the note there); this file is their bookkeeping. Names follow
``CUDACachingAllocator.cpp`` (``get_free_block``, ``alloc_block``, ``should_split``,
``release_cached_blocks``) so each piece can be read next to the original.

Addresses are virtual: each new segment starts where the previous one ended, so
address order is creation order (the tie-break of best fit among equal sizes).
A pool's free list is a sorted list of ``(size, addr, block)`` and its unmapped
list one of ``(addr, block)``: ``bisect`` finds the best fit in O(log n) and the
insertions are C-level memmoves, so a replay of a 70B step's tens of thousands of
events costs a fraction of the fake step that produced them (``tests/
test_caching_allocator.py`` times one).
"""

from __future__ import annotations

from bisect import bisect_left, insort

from ..options.alloc_conf import LARGE_BUFFER, MIB, MIN_BLOCK, AllocatorConf

SMALL_SIZE = MIB  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: the small pool's segment
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: below it a large request takes a 20 MiB segment
ROUND_LARGE = 2 * MIB  # kRoundLarge: larger segments round up to this
ADDRESS_SPACE = LARGE_BUFFER << 26  # an expandable segment's virtual range: never the limit


class OutOfMemoryError(Exception):
    """No cached block fits and the capacity leaves no room, even after releasing."""


class Segment:
    """An expandable segment: its virtual base, page size and mapped bytes."""

    __slots__ = ("base", "page", "mapped")

    def __init__(self, base: int, page: int) -> None:
        self.base, self.page, self.mapped = base, page, 0


class Block:
    """A contiguous range of a segment: handed out, cached free, or (expandable) not
    backed by memory. ``prev``/``next``: the neighbours in the same segment."""

    __slots__ = (
        "addr",
        "size",
        "pool",
        "seg",
        "mapped",
        "allocated",
        "prev",
        "next",
        "gc_base",
        "requested",
    )

    def __init__(self, addr: int, size: int, pool: Pool, seg: Segment | None = None) -> None:
        self.addr, self.size, self.pool, self.seg = addr, size, pool, seg
        self.mapped, self.allocated = True, False
        self.requested = 0  # bytes asked for, while allocated
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_base = 0  # the pool's get_free_block count when the block was cached

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class Pool:
    """Free blocks of one size class (small: requests of at most 1 MiB) and stream."""

    __slots__ = ("small", "stream", "free", "unmapped", "calls")

    def __init__(self, small: bool, stream: int) -> None:
        self.small, self.stream = small, stream
        self.free: list[tuple[int, int, Block]] = []  # (size, addr, block), sorted
        self.unmapped: list[tuple[int, Block]] = []  # (addr, block), sorted
        self.calls = 0  # get_free_block calls: the clock of garbage collection


class Allocator:
    """One device's caching allocator. ``malloc``/``free`` as in PyTorch; counters
    ``reserved``, ``allocated`` (block bytes), ``segments`` alive."""

    def __init__(self, conf: AllocatorConf, capacity: int | None) -> None:
        self.conf, self.capacity = conf, capacity
        # GC and the fraction check run only under set_per_process_memory_fraction;
        # a capacity with a threshold stands for that limit.
        self.gc_on = capacity is not None and conf.garbage_collection_threshold > 0
        self.pools: dict[tuple[bool, int], Pool] = {}
        self.reserved = self.allocated = self.segments = 0
        self.segments_created = self.cache_releases = 0
        self.next_addr = 0

    # -- the public calls -------------------------------------------------------------

    def malloc(self, orig_size: int, stream: int) -> Block:
        size = self.conf.round_size(orig_size)
        pool = self._pool(size <= SMALL_SIZE, stream)
        block = self.get_free_block(pool, size) or self._new_block(pool, size)
        if self.should_split(block, size):
            self._split(block, size)
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:
            self._merge(block, prev)
        if nxt is not None and not nxt.allocated:
            self._merge(block, nxt)
        self._cache(block)

    # -- sizes ------------------------------------------------------------------------

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK
        limit = self.conf.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    # -- finding a block --------------------------------------------------------------

    def get_free_block(self, pool: Pool, size: int) -> Block | None:
        if self.gc_on:
            pool.calls += 1
        free = pool.free
        i = bisect_left(free, (size, -1))
        if i == len(free):
            return None
        if free[i][2].seg is not None:
            # an expandable block's size for best fit includes the unmapped range after it
            while i + 1 < len(free) and _reach(free[i + 1][2]) < _reach(free[i][2]):
                i += 1
        block = free[i][2]
        limit = self.conf.max_split_size
        if limit is not None:
            if size < limit <= block.size:
                return None  # an oversize block never serves a smaller request
            if size >= limit and block.size >= size + self.conf.max_non_split_rounding:
                return None  # nor an oversize request it would fit too loosely
        del free[i]
        return block

    def _new_block(self, pool: Pool, size: int) -> Block:
        if self.gc_on:
            self._garbage_collect()
        alloc_size = self.allocation_size(size)
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available(pool, size):
            self.cache_releases += 1
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.cache_releases += 1
            self.release_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            raise OutOfMemoryError(size)
        return block

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int) -> Block | None:
        if self.gc_on and self.reserved + alloc_size > self.capacity:
            return None  # the memory fraction's check counts the whole segment size
        if self.conf.expandable_segments:
            return self._alloc_expandable(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        block = Block(self.next_addr, alloc_size, pool)
        self.next_addr += alloc_size
        self.reserved += alloc_size
        self.segments += 1
        self.segments_created += 1
        return block

    def _split(self, block: Block, size: int) -> None:
        """Keep the front of ``block`` for the request; cache the rest."""
        rest = Block(block.addr + size, block.size - size, block.pool, block.seg)
        _link_after(block, rest)
        block.size = size
        self._cache(rest)

    # -- expandable segments ----------------------------------------------------------

    def _alloc_expandable(self, pool: Pool, size: int) -> Block | None:
        block = self._find_expandable(pool, size)
        if not block.mapped and not self._map(block, min(block.size, size)):
            return None
        while block.size < size:  # free (mapped) -> unmapped: map more and merge
            after = block.next
            if not self._map(after, min(size - block.size, after.size)):
                return None
            block = after
        self._uncache(block)
        return block

    def _find_expandable(self, pool: Pool, size: int) -> Block:
        """The lowest address with room for ``size`` in free and unmapped ranges."""
        for _, block in pool.unmapped:
            if block.prev is not None and not block.prev.allocated:
                block = block.prev
            if _room(block, size):
                return block
        seg = Segment(self.next_addr, SMALL_BUFFER if pool.small else LARGE_BUFFER)
        self.next_addr += ADDRESS_SPACE
        block = Block(seg.base, ADDRESS_SPACE, pool, seg)
        block.mapped = False
        insort(pool.unmapped, (block.addr, block))
        return block

    def _map(self, block: Block, size: int) -> bool:
        """Back the first pages of the unmapped ``block`` covering ``size`` bytes."""
        seg = block.seg
        begin = (block.addr - seg.base) // seg.page
        end = -(-(block.addr + size - seg.base) // seg.page)
        nbytes = (end - begin) * seg.page
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        _remove(block.pool.unmapped, (block.addr, block))
        block.mapped = True
        if nbytes < block.size:
            rest = Block(block.addr + nbytes, block.size - nbytes, block.pool, seg)
            rest.mapped = False
            _link_after(block, rest)
            insort(block.pool.unmapped, (rest.addr, rest))
            block.size = nbytes
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._cache(block)
        self._mapped(seg, nbytes)
        self.segments_created += 1
        return True

    def _unmap(self, block: Block) -> None:
        """Give back the whole pages inside the free ``block``; its ends stay cached."""
        seg = block.seg
        begin = -(-(block.addr - seg.base) // seg.page)
        end = (block.addr + block.size - seg.base) // seg.page
        if begin >= end:
            return
        self._uncache(block)
        start, stop = seg.base + begin * seg.page, seg.base + end * seg.page
        if start > block.addr:
            before = Block(block.addr, start - block.addr, block.pool, seg)
            _link_after(block.prev, before, block)
            self._cache(before)
        if stop < block.addr + block.size:
            after = Block(stop, block.addr + block.size - stop, block.pool, seg)
            _link_after(block, after)
            self._cache(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        insort(block.pool.unmapped, (block.addr, block))
        self._mapped(seg, -(stop - start))

    def _mapped(self, seg: Segment, delta: int) -> None:
        was = seg.mapped
        seg.mapped += delta
        self.reserved += delta
        self.segments += (seg.mapped > 0) - (was > 0)

    # -- giving memory back -----------------------------------------------------------

    def release_cached_blocks(self) -> None:
        """Every wholly free segment back to the driver (expandable: every free page)."""
        for pool in self.pools.values():
            for _, _, block in list(pool.free):
                if block.seg is not None:
                    self._unmap(block)
                elif not block.is_split:
                    self._release(block)
            for _, block in list(pool.unmapped):
                if not block.is_split:  # a segment with nothing mapped is dropped
                    _remove(pool.unmapped, (block.addr, block))

    def _release(self, block: Block) -> None:
        self._uncache(block)
        self.reserved -= block.size
        self.segments -= 1

    def _release_available(self, pool: Pool, size: int) -> bool:
        """Release oversize cached segments, just enough for ``size``: the smallest one
        that is large enough, else the largest ones down (with ``max_split_size``)."""
        limit = self.conf.max_split_size
        if limit is None or self.conf.expandable_segments:
            return False
        key = max(size, limit)
        free = pool.free
        i = bisect_left(free, (key, -1))
        if i < len(free):
            if free[i][2].is_split:
                return False
            self._release(free[i][2])
            return True
        released = 0
        for block_size, _, block in reversed(list(free)):
            if released >= key or block_size < limit:
                break
            if not block.is_split:
                released += block_size
                self._release(block)
        return released >= key

    def _garbage_collect(self) -> None:
        """Release the large pool's wholly free segments that have waited longest (at
        least the average wait, again until enough), once reserved passes the
        threshold's share of the capacity."""
        threshold = int(self.conf.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        cands = [b for p in self._large_pools() for _, _, b in p.free if not b.is_split]
        ages = {id(b): b.pool.calls - b.gc_base for b in cands}
        total = sum(ages.values())
        while reclaimed < target and cands:
            average = total / len(cands)
            keep = []
            for b in cands:
                if ages[id(b)] >= average:
                    reclaimed += b.size
                    total -= ages[id(b)]
                    self._release(b)
                else:
                    keep.append(b)
            if len(keep) == len(cands):
                break
            cands = keep

    # -- lists ------------------------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> Pool:
        pool = self.pools.get((small, stream))
        if pool is None:
            pool = self.pools[(small, stream)] = Pool(small, stream)
        return pool

    def _large_pools(self) -> list[Pool]:
        return [p for (small, _), p in sorted(self.pools.items()) if not small]

    def _cache(self, block: Block) -> None:
        block.gc_base = block.pool.calls
        insort(block.pool.free, (block.size, block.addr, block))

    @staticmethod
    def _uncache(block: Block) -> None:
        _remove(block.pool.free, (block.size, block.addr, block))

    def _merge(self, dst: Block, src: Block | None) -> None:
        """Fold the free neighbour ``src`` into ``dst`` (both mapped or both not)."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._uncache(src)
        else:
            _remove(src.pool.unmapped, (src.addr, src))
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size


def _reach(block: Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


def _room(block: Block | None, size: int) -> bool:
    got = 0
    while got < size and block is not None and not block.allocated:
        got += block.size
        block = block.next
    return got >= size


def _link_after(block: Block | None, new: Block, after: Block | None = None) -> None:
    """Put ``new`` right after ``block`` (None: at the segment's start, before ``after``)."""
    if block is not None:
        after = block.next
        block.next = new
    new.prev, new.next = block, after
    if after is not None:
        after.prev = new


def _remove(items: list, key: tuple) -> None:
    i = bisect_left(items, key)
    assert items[i] == key, "allocator model: a cached block is missing from its list"
    del items[i]
