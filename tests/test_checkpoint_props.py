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
        convert_checkpoint(src, first, world_size=n, align=align, sharded=sharded_in)
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
    from yafsdp_cli.checkpoint.check import padding
    from yafsdp_cli.engine import dtypes

    spec = ModelSpec(
        tuple(TensorRecord(f"p{i}", s, dtype) for i, s in enumerate(shapes)),
        has_architecture=False,
    )
    (b,) = plan(spec, world_size=world_size, align=align).buffers
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
