"""Layout invariants, by hand and over random models (hypothesis)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from yafsdp_cli import LayoutError, ModelSpec, TensorRecord, YafsdpError, parse_align, plan
from yafsdp_cli.engine.layout import check_layout, plan_layout
from yafsdp_cli.engine.units import assign_units
from yafsdp_cli.options import LayoutOptions

FLOATS = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn")


def spec_of(*shapes, dtype="float32") -> ModelSpec:
    return ModelSpec(
        tuple(TensorRecord(f"p{i}", s, dtype) for i, s in enumerate(shapes)), has_architecture=False
    )


@pytest.mark.parametrize(
    ("align", "offsets", "padded"),
    [
        ("yafsdp", [0, 15, 22], 32),  # packed; 23 -> multiple of 4 ranks x 8
        ("none", [0, 15, 22], 24),  # packed; 23 -> multiple of 4
        ("fsdp", [0, 16, 24], 28),  # 16-byte (4-element) starts; 25 -> multiple of 4
        ("megatron", [0, 64, 128], 256),  # 64-element starts; 129 -> multiple of lcm(4, 128)
        ("32", [0, 16, 24], 32),  # 32-byte starts (8 elements); shards of 8 elements
    ],
)
def test_hand_computed_offsets(align, offsets, padded):
    layout = plan(spec_of((3, 5), (7,), ()), LayoutOptions(world_size=4, align=align))
    (buf,) = layout.buffers
    assert [e.offset for e in buf.entries] == offsets
    assert buf.padded_numel == padded
    assert buf.numel == 23 and buf.shard_numel == padded // 4


def test_shard_pieces_by_hand():
    (buf,) = plan(spec_of((3, 5), (7,), ()), LayoutOptions(world_size=4)).buffers  # shards of 8
    assert [(p.entry, p.start, p.end, p.flat_start) for p in buf.shard(1)] == [
        ("p0", 8, 15, 8),
        ("p1", 0, 1, 15),
    ]
    assert [(p.entry, p.start, p.end) for p in buf.shard(2)] == [("p1", 1, 7), ("p2", 0, 1)]
    assert buf.shard(3) == ()  # all padding
    with pytest.raises(LayoutError, match="rank 4 is outside world size 4"):
        buf.shard(4)


records = st.builds(
    lambda shape, dtype, unit: (shape, dtype, unit),
    st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
    st.sampled_from(FLOATS),
    st.sampled_from(["", "blocks.0", "blocks.1"]),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(records, min_size=1, max_size=12),
    st.integers(1, 16),
    st.sampled_from(["yafsdp", "fsdp", "megatron", "none", "1", "6", "16", "128"]),
)
def test_random_layouts_keep_every_invariant(items, world_size, align):
    tensors = tuple(
        TensorRecord(f"{unit + '.' if unit else ''}w{i}", shape, dtype)
        for i, (shape, dtype, unit) in enumerate(items)
    )
    spec = ModelSpec(tensors, has_architecture=False)
    units = ("blocks.0", "blocks.1")
    layout = plan_layout(
        spec, tensors, assign_units(spec, units), LayoutOptions(world_size=world_size, align=align)
    )
    policy = parse_align(align)
    seen = []
    for b in layout.buffers:
        size = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[
            b.dtype
        ]
        assert b.padded_numel % world_size == 0
        assert 0 <= b.padded_numel - b.end < b.end_multiple or b.end == b.padded_numel == 0
        if align == "yafsdp":
            assert b.shard_numel % 8 == 0
        if align == "megatron":
            assert b.padded_numel % math.lcm(world_size, 128) == 0
        prev = 0
        for e in b.entries:
            assert e.offset >= prev
            prev = e.offset + e.numel
            assert (e.offset * size) % policy.start_bytes == 0
            assert e.offset % policy.start_elems == 0
            assert all(e.name.startswith(b.unit + ".") for _ in [0] if b.unit)
            seen.append(e.name)
        # Shards partition the buffer: every entry element is owned exactly once.
        owned = {e.name: [] for e in b.entries}
        for r in range(world_size):
            lo, hi = r * b.shard_numel, (r + 1) * b.shard_numel
            for p in b.shard(r):
                assert lo <= p.flat_start and p.flat_start + p.end - p.start <= hi
                owned[p.entry].append((p.start, p.end))
        for e in b.entries:
            spans = sorted(owned[e.name])
            assert sum(hi - lo for lo, hi in spans) == e.numel
            assert all(a[1] == b_[0] for a, b_ in zip(spans, spans[1:]))
    assert sorted(seen) == sorted(t.name for t in tensors)


def _tamper(layout, **changes):
    b = layout.buffers[0]
    return dataclasses.replace(layout, buffers=(dataclasses.replace(b, **changes),))


def test_check_layout_catches_broken_invariants():
    layout = plan(spec_of((4,), (4,)), LayoutOptions(world_size=2, align="fsdp"))
    b = layout.buffers[0]
    e0, e1 = b.entries
    overlap = (e0, dataclasses.replace(e1, offset=2))
    with pytest.raises(LayoutError, match="overlapping|not a multiple"):
        check_layout(_tamper(layout, entries=overlap))
    with pytest.raises(LayoutError, match="offset 5 not a multiple of 4"):
        check_layout(_tamper(layout, entries=(e0, dataclasses.replace(e1, offset=5)), end=9))
    with pytest.raises(LayoutError, match="padded numel 9"):
        check_layout(_tamper(layout, padded_numel=9))
    with pytest.raises(LayoutError, match="numel 5 != prod"):
        check_layout(_tamper(layout, entries=(dataclasses.replace(e0, numel=5), e1)))
    dup = (e0, dataclasses.replace(e1, name="p0"))
    with pytest.raises(LayoutError, match="'p0' appears twice"):
        check_layout(_tamper(layout, entries=dup))
    clash = dataclasses.replace(layout, kept=(TensorRecord("p1", (1,), "float32"),))
    with pytest.raises(LayoutError, match="'p1' appears twice"):
        check_layout(clash)


def test_bad_align_and_world_size_are_errors():
    with pytest.raises(YafsdpError, match="--align 'fast' is not"):
        parse_align("fast")
    with pytest.raises(YafsdpError, match="--align '0'"):
        parse_align("0")
    with pytest.raises(YafsdpError, match="at least 1"):
        plan(spec_of((2,)), LayoutOptions(world_size=0))


def test_buffers_split_by_dtype_and_keep_non_selected_tensors():
    spec = ModelSpec(
        (
            TensorRecord("a", (2,), "bfloat16"),
            TensorRecord("b", (2,), "float32"),
            TensorRecord("steps", (), "int64", is_param=False),
        ),
        has_architecture=False,
    )
    layout = plan(spec)
    assert [b.name for b in layout.buffers] == ["__flat__.bfloat16", "__flat__.float32"]
    assert [t.name for t in layout.kept] == ["steps"]


def test_layout_round_trips_through_json_and_refuses_malformed():
    import json

    from yafsdp_cli.engine.layout import layout_from_dict, layout_to_dict

    spec = ModelSpec(
        (
            TensorRecord("a", (3, 2), "bfloat16", aliases=("tied.a",)),
            TensorRecord("b", (), "float32"),
            TensorRecord("stats", (4,), "float32", is_param=False),
        ),
        has_architecture=False,
    )
    layout = plan(spec, LayoutOptions(filters=["name:a"], world_size=3, align="megatron"))
    data = json.loads(json.dumps(layout_to_dict(layout)))
    assert layout_from_dict(data) == layout
    with pytest.raises(LayoutError, match="version 7 is not 1"):
        layout_from_dict({**data, "version": 7})
    with pytest.raises(LayoutError, match="malformed.*'buffers'"):
        layout_from_dict({k: v for k, v in data.items() if k != "buffers"})
    data["buffers"][0]["padded_numel"] = 129
    with pytest.raises(LayoutError, match="padded numel 129"):
        layout_from_dict(data)
