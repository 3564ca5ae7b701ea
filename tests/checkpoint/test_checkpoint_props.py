"""Round trips over random models: shapes, dtypes, alignments, world sizes (hypothesis)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from checkpoint_helpers import assert_same_tensors, load_st
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from yafsdp_cli.checkpoint import (
    convert_checkpoint,
    open_flat,
    reshard_checkpoint,
    restore_checkpoint,
)
from yafsdp_cli.options import LayoutOptions

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8)

tensors = st.lists(
    st.tuples(
        st.sampled_from(["blocks.0.", "blocks.1.", "head.", "blocks.0.sub.", "blocks.1.sub."]),
        st.lists(st.integers(0, 9), max_size=3).map(tuple),
        st.sampled_from(DTYPES),
    ),
    min_size=1,
    max_size=8,
)


def make_state_dict(items, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (prefix, shape, dtype) in enumerate(items):
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        else:
            t = torch.randint(0, 200, shape, generator=g).to(dtype)
        out[f"{prefix}w{i}"] = t
    return out


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=tensors,
    seed=st.integers(0, 1000),
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    align=st.sampled_from(["yafsdp", "fsdp", "megatron", "none", "32"]),
    sharded_in=st.booleans(),
    sharded_out=st.booleans(),
)
def test_random_round_trip(items, seed, n, m, align, sharded_in, sharded_out):
    state = make_state_dict(items, seed)
    work = Path(tempfile.mkdtemp())
    try:
        src = work / "src.safetensors"
        save_file(state, str(src))
        first = work / ("a" if sharded_in else "a.safetensors")
        convert_checkpoint(src, first, LayoutOptions(world_size=n, align=align), sharded=sharded_in)
        second = work / ("b" if sharded_out else "b.safetensors")
        reshard_checkpoint(first, second, world_size=m, sharded=sharded_out)
        ckpt = open_flat(second)
        assert ckpt.layout.world_size == m and ckpt.shards == (m if sharded_out else 1)
        for b in ckpt.layout.buffers:
            assert b.padded_numel % m == 0
        restore_checkpoint(second, work / "c.safetensors")
        assert_same_tensors(state, load_st(work / "c.safetensors"))
    finally:
        shutil.rmtree(work)


shapes = st.lists(st.lists(st.integers(0, 6), max_size=2).map(tuple), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(
    shapes=shapes,
    dtype=st.sampled_from(["float32", "bfloat16", "float64"]),
    world_size=st.integers(1, 5),
    align=st.sampled_from(["yafsdp", "fsdp", "megatron", "none", "32"]),
    sharded=st.booleans(),
)
def test_padding_ranges_cover_exactly_the_bytes_no_entry_covers(
    shapes, dtype, world_size, align, sharded
):
    from yafsdp_cli import ModelSpec, TensorRecord, plan
    from yafsdp_cli.checkpoint.integrity import padding
    from yafsdp_cli.engine import dtypes

    spec = ModelSpec(
        tuple(TensorRecord(f"p{i}", s, dtype) for i, s in enumerate(shapes)),
        has_architecture=False,
    )
    (b,) = plan(spec, LayoutOptions(world_size=world_size, align=align)).buffers
    isz = dtypes.itemsize(dtype)
    covered = [False] * b.padded_numel
    for e in b.entries:
        covered[e.offset : e.offset + e.numel] = [True] * e.numel
    shards = world_size if sharded else 1
    size = b.padded_numel // shards
    for r in range(shards):
        expected = [not c for c in covered[r * size : (r + 1) * size] for _ in range(isz)]
        got = [False] * (size * isz)
        for a, z in padding(b, r, shards):
            assert a < z
            got[a:z] = [True] * (z - a)
        assert got == expected


def files_of(path: Path) -> dict[str, bytes]:
    """Every file of a flat checkpoint (one file, or a set's folder) by name."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return {"": path.read_bytes()}


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    items=tensors,
    ties=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3)), max_size=3),
    seed=st.integers(0, 1000),
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    align=st.sampled_from(["yafsdp", "fsdp", "megatron", "none", "32", "64"]),
    sharded=st.booleans(),
)
def test_tied_groups_round_trip_and_reshard_there_and_back_is_the_identity(
    items, ties, seed, n, m, align, sharded
):
    """A ``.pt`` state dict with tied names (one tensor under several names): the
    flat layout keeps every invariant, N -> M -> N gives the very same bytes as the
    first conversion, and restore gives every tensor and every tied name back."""
    from yafsdp_cli.checkpoint.reshard import relayout
    from yafsdp_cli.engine.layout import check_layout

    state = make_state_dict(items, seed)
    names = list(state)
    for i, (which, copies) in enumerate(ties):  # tie: more names for one tensor
        kept = names[which % len(names)]
        for c in range(copies):
            state[f"tied.{i}.{c}.{kept}"] = state[kept]
    work = Path(tempfile.mkdtemp())
    try:
        src = work / "src.pt"
        torch.save(state, src)
        first = work / ("a" if sharded else "a.safetensors")
        convert_checkpoint(src, first, LayoutOptions(world_size=n, align=align), sharded=sharded)
        layout = open_flat(first).layout
        check_layout(layout)
        assert relayout(relayout(layout, m), n) == layout
        middle = work / "b.safetensors"
        reshard_checkpoint(first, middle, world_size=m)
        back = work / ("c" if sharded else "c.safetensors")
        reshard_checkpoint(middle, back, world_size=n, sharded=sharded)
        assert files_of(back) == files_of(first)  # byte for byte, metadata included
        restore_checkpoint(back, work / "d.pt")
        restored = torch.load(work / "d.pt", weights_only=True)
        assert_same_tensors(state, restored)
        for name, t in state.items():  # a tie comes back as one shared tensor
            twins = [o for o, u in state.items() if u is t]
            ptrs = {restored[o].untyped_storage().data_ptr() for o in twins}
            assert len(ptrs) == 1 or not t.numel(), (name, twins)
    finally:
        shutil.rmtree(work)
