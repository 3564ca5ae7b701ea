"""The caching allocator's model on hand-worked traces, its settings' parser, and
properties over random traces.

Each expected figure is worked out by hand from the rules in
``memory/caching_allocator.py``'s note (the comment beside it shows the working);
none is a figure the model produced.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import ROOT
from helpers import options
from hypothesis import given, settings
from hypothesis import strategies as st

from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.memory import (
    AllocatorConf,
    AllocTrace,
    TraceEvent,
    first_fit,
    parse_alloc_conf,
    reserved_of,
)
from yafsdp_cli.memory.alloc_segments import Allocator, OutOfMemoryError
from yafsdp_cli.profiling import ProfileOptions, profile_model
from yafsdp_cli.sources import load_source

KIB, MIB = 1 << 10, 1 << 20


def trace(*pairs) -> AllocTrace:
    return AllocTrace.from_pairs(pairs)


# -- pools, rounding, splits ----------------------------------------------------------


def test_a_small_request_splits_a_2mib_segment_and_the_rest_serves_the_next():
    est = reserved_of(trace((0, 1000), (1, 4096)))
    assert est.reserved_peak == 2 * MIB  # one small segment
    assert est.allocated_peak == 1024 + 4096  # 1000 B rounds up to 1024
    assert est.segments == 1
    assert est.fragmentation == 2 * MIB - 1024


def test_a_freed_block_is_reused_not_allocated_again():
    est = reserved_of(trace((0, 5 * MIB), (0, None), (1, 5 * MIB)))
    assert est.reserved_peak == 20 * MIB  # a 1-10 MiB request carves a 20 MiB segment
    assert est.segments_created == 1


def test_a_large_block_is_not_split_for_a_remainder_of_1mib_or_less():
    # 12 MiB segment; 11.5 MiB leaves 0.5 MiB: not split, so the whole block counts
    est = reserved_of(trace((0, 12 * MIB), (0, None), (1, 11 * MIB + 512 * KIB)))
    assert est.reserved_peak == 12 * MIB
    assert est.allocated_peak == 12 * MIB
    # ... but 9 MiB leaves 3 MiB: split, 9 MiB allocated
    est = reserved_of(trace((0, 12 * MIB), (0, None), (1, 9 * MIB)))
    assert (est.reserved_peak, est.allocated_peak) == (12 * MIB, 12 * MIB)
    est = reserved_of(trace((0, 12 * MIB), (0, None), (1, 9 * MIB), (2, 3 * MIB)))
    assert est.reserved_peak == 12 * MIB  # the 3 MiB rest serves the next request


def test_freed_neighbours_merge_into_one_block():
    # two 5 MiB blocks at the front of a 20 MiB segment; both freed: one 20 MiB block
    pairs = [(0, 5 * MIB), (1, 5 * MIB), (0, None), (1, None), (2, 18 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == 20 * MIB
    # with the second still held, the first 5 MiB and the last 10 MiB are apart
    pairs = [(0, 5 * MIB), (1, 5 * MIB), (0, None), (2, 12 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == 20 * MIB + 12 * MIB


def test_small_and_large_pools_meet_at_1mib():
    assert reserved_of(trace((0, MIB))).reserved_peak == 2 * MIB
    assert reserved_of(trace((0, MIB + 1))).reserved_peak == 20 * MIB
    # a small block never serves a large request, nor the reverse
    est = reserved_of(trace((0, 512 * KIB), (0, None), (1, MIB + 1)))
    assert est.reserved_peak == 2 * MIB + 20 * MIB


def test_segments_of_large_requests_at_10mib():
    assert reserved_of(trace((0, 10 * MIB - 512))).reserved_peak == 20 * MIB
    assert reserved_of(trace((0, 10 * MIB))).reserved_peak == 10 * MIB
    assert reserved_of(trace((0, 10 * MIB + 1))).reserved_peak == 12 * MIB  # 2 MiB steps


def test_streams_do_not_share_cached_blocks():
    events = [TraceEvent(0, 5 * MIB, 0), TraceEvent(0, 0, 0), TraceEvent(1, 5 * MIB, 7)]
    assert reserved_of(AllocTrace(tuple(events))).reserved_peak == 40 * MIB
    events[2] = TraceEvent(1, 5 * MIB, 0)
    assert reserved_of(AllocTrace(tuple(events))).reserved_peak == 20 * MIB


def test_roundup_power2_divisions():
    # 17 MiB + 1: by 512 B then 2 MiB segments, 18 MiB; with 4 divisions between 16
    # and 32 MiB (steps of 4 MiB), 20 MiB
    assert reserved_of(trace((0, 17 * MIB + 1))).reserved_peak == 18 * MIB
    est = reserved_of(trace((0, 17 * MIB + 1)), "roundup_power2_divisions:4")
    assert est.reserved_peak == 20 * MIB
    est = reserved_of(trace((0, 5 * MIB + 1)), "roundup_power2_divisions:4")
    assert est.allocated_peak == 6 * MIB  # 4 MiB + one 1 MiB step
    # a list: 1 division (off) up to 256 MiB, so 17 MiB rounds as by default
    est = reserved_of(trace((0, 17 * MIB + 1)), "roundup_power2_divisions:[256:1,>:4]")
    assert est.reserved_peak == 18 * MIB


# -- oversize blocks ------------------------------------------------------------------


def test_an_oversize_block_does_not_serve_a_smaller_request():
    pairs = [(0, 100 * MIB), (0, None), (1, 30 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == 100 * MIB  # split: 30 + 70
    est = reserved_of(trace(*pairs), "max_split_size_mb:64")
    assert est.reserved_peak == 130 * MIB


def test_an_oversize_request_takes_a_cached_block_within_20mib_whole():
    pairs = [(0, 100 * MIB), (0, None), (1, 90 * MIB)]
    est = reserved_of(trace(*pairs), "max_split_size_mb:64")
    assert (est.reserved_peak, est.allocated_peak) == (100 * MIB, 100 * MIB)  # not split
    pairs = [(0, 100 * MIB), (0, None), (1, 70 * MIB)]  # 100 >= 70 + 20: refused
    est = reserved_of(trace(*pairs), "max_split_size_mb:64")
    assert est.reserved_peak == 170 * MIB
    est = reserved_of(trace(*pairs), "max_split_size_mb:64,max_non_split_rounding_mb:40")
    assert est.reserved_peak == 100 * MIB


# -- expandable segments --------------------------------------------------------------


def test_expandable_segments_grow_in_20mib_pages():
    pairs = [(0, 3 * MIB), (1, 25 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == (20 + 26) * MIB
    est = reserved_of(trace(*pairs), "expandable_segments:True")
    assert est.reserved_peak == 40 * MIB  # 28 MiB in one segment: two pages
    assert est.segments == 1
    small = reserved_of(trace((0, 1000), (1, 3 * MIB)), "expandable_segments:True")
    assert small.reserved_peak == 2 * MIB + 20 * MIB  # a 2 MiB-page segment per pool


def test_expandable_segments_can_reserve_more_than_a_whole_cached_block():
    # default: 5 MiB carves segment A (20 MiB), 19 MiB takes all of B (a 1 MiB rest is
    # not split off); the freed 5 MiB merges back into a whole A, which the second
    # 19 MiB takes: 40 MiB
    pairs = [(0, 5 * MIB), (1, 19 * MIB), (0, None), (2, 19 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == 40 * MIB
    # expandable: 5 + 19 MiB map two pages and leave 16 MiB free at the end; the freed
    # 5 MiB at the front is cut off by the 19 MiB block, so the second 19 MiB maps a
    # third page after the 16 MiB: 60 MiB
    est = reserved_of(trace(*pairs), "expandable_segments:True")
    assert est.reserved_peak == 60 * MIB
    # a 4 MiB request fits the 5 MiB gap (best fit), no page mapped
    pairs[-1] = (2, 4 * MIB)
    assert reserved_of(trace(*pairs), "expandable_segments:True").reserved_peak == 40 * MIB


# -- capacity, release, garbage collection -------------------------------------------


def test_a_capacity_releases_cached_segments_before_it_fails():
    pairs = [(0, 60 * MIB), (0, None), (1, 70 * MIB)]
    assert reserved_of(trace(*pairs)).reserved_peak == 130 * MIB
    est = reserved_of(trace(*pairs), capacity=100 * MIB)
    assert est.fits and est.reserved_peak == 70 * MIB and est.cache_releases == 1
    held = reserved_of(trace((0, 60 * MIB), (1, 70 * MIB)), capacity=100 * MIB)
    assert held.fits is False and held.oom_event == 1


def test_a_split_segment_cannot_be_released():
    # the 20 MiB segment keeps a 5 MiB block: 20 + 90 > 100 MiB even after release
    pairs = [(0, 5 * MIB), (1, 5 * MIB), (0, None), (2, 90 * MIB)]
    assert reserved_of(trace(*pairs), capacity=100 * MIB).oom_event == 3
    assert reserved_of(trace(*pairs), capacity=110 * MIB).fits


def test_expandable_segments_unmap_free_pages_at_a_capacity():
    # 30 MiB on stream 0 maps 40 MiB; freed, then stream 1 needs its own segment
    events = (TraceEvent(0, 30 * MIB, 0), TraceEvent(0, 0, 0), TraceEvent(1, 30 * MIB, 1))
    conf = "expandable_segments:True"
    assert reserved_of(AllocTrace(events), conf).reserved_peak == 80 * MIB
    est = reserved_of(AllocTrace(events), conf, capacity=60 * MIB)
    assert est.fits and est.reserved_peak == 40 * MIB and est.cache_releases == 1


def test_oversize_blocks_are_released_first_with_max_split_size():
    # 100 MiB (oversize) and 30 MiB cached, 20 MiB split: 150 MiB reserved. 60 MiB is
    # refused the oversize block and 150 + 60 > 170: only the oversize block is
    # released (then 110 MiB), the 30 MiB stays cached
    alloc = Allocator(parse_alloc_conf("max_split_size_mb:64"), 170 * MIB)
    a, _, c = (alloc.malloc(n * MIB, 0) for n in (100, 5, 30))
    alloc.free(a)
    alloc.free(c)
    assert alloc.reserved == 150 * MIB
    alloc.malloc(60 * MIB, 0)
    assert (alloc.reserved, alloc.cache_releases) == (110 * MIB, 1)
    # without max_split_size the 60 MiB splits the 100 MiB block: nothing released
    plain = Allocator(AllocatorConf(), 170 * MIB)
    a, _, c = (plain.malloc(n * MIB, 0) for n in (100, 5, 30))
    plain.free(a)
    plain.free(c)
    plain.malloc(60 * MIB, 0)
    assert (plain.reserved, plain.cache_releases) == (150 * MIB, 0)


def test_garbage_collection_threshold_releases_old_cached_segments():
    # capacity 200 MiB, threshold 0.25: past 50 MiB reserved, a miss first frees the
    # cached 60 MiB segment, so the 70 MiB request finds 0 reserved, not 60
    pairs = [(0, 60 * MIB), (0, None), (1, 70 * MIB)]
    gc = "garbage_collection_threshold:0.25"
    assert reserved_of(trace(*pairs), gc, capacity=200 * MIB).reserved_peak == 70 * MIB
    assert reserved_of(trace(*pairs), capacity=200 * MIB).reserved_peak == 130 * MIB
    # below the threshold nothing is collected
    low = reserved_of(trace(*pairs), "garbage_collection_threshold:0.5", capacity=200 * MIB)
    assert low.reserved_peak == 130 * MIB


def test_first_fit_names_the_setting_that_fits():
    pairs = [(0, 3 * MIB), (1, 25 * MIB)]  # 46 MiB by default, 40 MiB expandable
    est = first_fit(trace(*pairs), 45 * MIB, ["default", "expandable_segments:True"])
    assert est is not None and est.conf == "expandable_segments:True"
    assert first_fit(trace(*pairs), 39 * MIB, ["default", "expandable_segments:True"]) is None


def test_bad_traces_are_refused():
    with pytest.raises(YafsdpError, match="block 3 is freed but not allocated"):
        reserved_of(trace((3, None)))
    with pytest.raises(YafsdpError, match="block 1 is allocated twice"):
        reserved_of(trace((1, 512), (1, 512)))


# -- PYTORCH_CUDA_ALLOC_CONF ----------------------------------------------------------


def test_the_conf_parser_reads_every_setting():
    text = (
        "expandable_segments:True,max_split_size_mb:128,"
        "garbage_collection_threshold:0.6,roundup_power2_divisions:4"
    )
    conf = parse_alloc_conf(text)
    assert conf == AllocatorConf(
        expandable_segments=True,
        max_split_size=128 * MIB,
        garbage_collection_threshold=0.6,
        roundup_power2_divisions=(4,) * 16,
    )
    assert str(conf) == text
    assert parse_alloc_conf(str(conf)) == conf
    assert parse_alloc_conf(None) == parse_alloc_conf("") == AllocatorConf()
    assert parse_alloc_conf("backend:native , expandable_segments:False") == AllocatorConf()


def test_the_conf_parser_reads_a_divisions_list():
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert conf.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert conf.divisions_for(300 * MIB) == 1  # 256-512 MiB is interval 8
    assert conf.divisions_for(600 * MIB) == 2
    assert conf.divisions_for(5 << 30) == 8
    assert parse_alloc_conf(str(conf)) == conf


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_split_size_mb:20", "max_split_size_mb must be above 20, got 20"),
        ("max_split_size_mb:lots", "max_split_size_mb must be a whole number, got 'lots'"),
        ("expandable_segments:yes", "expandable_segments must be True or False, got 'yes'"),
        ("garbage_collection_threshold:1.5", "between 0 and 1 .exclusive., got 1.5"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions: 3 is not a power of two"),
        ("roundup_power2_divisions:[256:3]", "3 is not a power of two"),
        ("roundup_power2_divisions:[256:1", "'\\[' without '\\]'"),
        ("max_split_size_mb", "'max_split_size_mb' is not key:value"),
        ("max_split_size_mb:64,max_split_size_mb:128", "'max_split_size_mb' is given twice"),
        ("expandible_segments:True", "unknown allocator setting 'expandible_segments'"),
    ],
)
def test_the_conf_parser_says_what_is_wrong(text, message):
    with pytest.raises(YafsdpError, match=message) as info:
        parse_alloc_conf(text)
    assert "\n" not in str(info.value)


# -- properties -----------------------------------------------------------------------

SIZES = st.one_of(
    st.integers(1, 2 * MIB),  # small and just-large
    st.integers(MIB, 40 * MIB),  # the 20 MiB segments and their boundaries
    st.sampled_from([MIB, MIB + 1, 10 * MIB - 1, 10 * MIB, 10 * MIB + 1, 64 * MIB]),
)
CONFS = st.sampled_from(
    [
        "default",
        "expandable_segments:True",
        "max_split_size_mb:32",
        "roundup_power2_divisions:4",
        "max_split_size_mb:24,roundup_power2_divisions:[1:2,>:8]",
    ]
)


@st.composite
def traces(draw) -> list[TraceEvent]:
    """Allocations and frees in a random order, on one or two streams."""
    live: list[int] = []
    events, next_id = [], 0
    for _ in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            block = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append(TraceEvent(block, 0, 0))
        else:
            events.append(TraceEvent(next_id, draw(SIZES), draw(st.sampled_from([0, 0, 1]))))
            live.append(next_id)
            next_id += 1
    return events


def _check_books(alloc: Allocator) -> None:
    cached = sum(size for p in alloc.pools.values() for size, _, _ in p.free)
    assert alloc.reserved >= alloc.allocated
    assert alloc.reserved == alloc.allocated + cached  # every reserved byte is accounted


@settings(max_examples=150, deadline=None)
@given(events=traces(), conf=CONFS, capacity=st.one_of(st.none(), st.integers(0, 200 * MIB)))
def test_reserved_covers_allocated_after_every_event(events, conf, capacity):
    alloc = Allocator(parse_alloc_conf(conf), capacity)
    live = {}
    for ev in events:
        if ev.size:
            try:
                live[ev.block] = alloc.malloc(ev.size, ev.stream)
            except OutOfMemoryError:
                return
        else:
            alloc.free(live.pop(ev.block))
        _check_books(alloc)
        if capacity is not None:
            assert alloc.reserved <= capacity


@settings(max_examples=100, deadline=None)
@given(events=traces(), conf=CONFS)
def test_the_same_trace_gives_the_same_answer(events, conf):
    first = reserved_of(events, conf)
    assert reserved_of(list(events), parse_alloc_conf(conf)) == first
    assert first.reserved_peak >= first.allocated_peak >= first.requested_peak
    assert first.fragmentation == first.reserved_peak - first.allocated_at_peak >= 0


@settings(max_examples=60, deadline=None)
@given(events=traces(), conf=CONFS)
def test_a_capacity_of_the_unlimited_peak_always_fits(events, conf):
    free = reserved_of(events, conf)
    limited = reserved_of(events, conf, capacity=free.reserved_peak)
    assert limited.fits and limited.reserved_peak <= free.reserved_peak


# -- speed ----------------------------------------------------------------------------


def layered_trace(layers: int, per_layer: int) -> AllocTrace:
    """A 70B-like step's shape: persistent weights, then per layer activations kept
    for backward and temporaries freed at once, then backward frees them in reverse."""
    events, n = [], 0
    sizes = [8 * MIB, 28 * MIB, 448 * KIB, 64 * MIB, 3 * MIB + 77, 112 * MIB, 2048]
    kept = []
    for layer in range(layers):
        for k in range(per_layer):
            size = sizes[(layer + k) % len(sizes)]
            events.append(TraceEvent(n, size, 0))
            if k % 3:
                events.append(TraceEvent(n, 0, 0))
            else:
                kept.append(n)
            n += 1
    for block in reversed(kept):
        events.append(TraceEvent(n, sizes[block % len(sizes)], 0))
        events.append(TraceEvent(n, 0, 0))
        events.append(TraceEvent(block, 0, 0))
        n += 1
    return AllocTrace(tuple(events))


@pytest.mark.parametrize("conf", ["default", "expandable_segments:True"])
def test_a_70b_sized_trace_replays_in_linear_time(conf):
    # 80 layers x 240 allocations: about 51,000 events, in about half a second on this
    # 2-core machine; a replay that scanned every block per event would take minutes
    events = layered_trace(80, 240)
    assert len(events.events) > 45_000
    start = time.perf_counter()
    est = reserved_of(events, conf)
    took = time.perf_counter() - start
    assert est.reserved_peak >= est.allocated_peak > 0
    assert took < 3.0, f"{len(events.events)} events took {took:.2f} s"


def test_a_replay_costs_a_small_part_of_the_fake_step_that_made_its_trace():
    traces: dict = {}
    report = profile_model(
        load_source(None, model="sample_models.models:llama"),
        options(ProfileOptions, fake=True, target="cuda", seq_len=128, param_dtype="bfloat16"),
        traces=traces,
    )
    for step in (report.original, report.converted_step):
        start = time.perf_counter()
        reserved_of(traces[step.variant])
        took = time.perf_counter() - start
        assert took < 0.2 * step.wall_s, (step.variant, took, step.wall_s)


def test_the_docs_page_runs():
    page = (ROOT / "docs" / "allocator.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/allocator.md", "exec"), {})
