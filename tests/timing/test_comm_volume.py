"""The collectives of one step under each scheme (``timing.comm_volume``): their bytes
against the layout, worked by hand, and their ring times."""

from __future__ import annotations

import pytest
import torch

from yafsdp_cli.engine.plan import plan
from yafsdp_cli.errors import YafsdpError
from yafsdp_cli.memory import MemoryConfig
from yafsdp_cli.memory.fsdp2 import place
from yafsdp_cli.options import LayoutOptions
from yafsdp_cli.schemes import DDP, FLAT, FSDP2, ZERO1, timed
from yafsdp_cli.sources import load_source
from yafsdp_cli.timing import Cluster, GpuSpec, collectives, ring_time, sent_bytes

GPU = GpuSpec("test", 2**30, 1e15, 2e15, 1e13, 2e12, 100e9, 8, "by hand")


@pytest.fixture(scope="module")
def llama_spec():
    return load_source(None, model="sample_models.models:llama").spec


@pytest.mark.parametrize("n", [2, 4, 8])
def test_flat_scheme_bytes_follow_the_layout_exactly(llama_spec, n):
    layout = plan(llama_spec, LayoutOptions(world_size=n))
    want = 0
    for b in layout.buffers:
        shard = b.shard_numel * b.nbytes // b.padded_numel  # bytes of one shard
        times = 1 + (b.unit != "") + b.requires_grad  # gather, gather again, reduce
        want += (n - 1) * shard * times
    found = collectives(layout, "yafsdp")
    assert sent_bytes(found) == want
    kinds = [(c.kind, c.phase) for c in found]
    assert kinds.count(("all_gather", "forward")) == len(layout.buffers)
    assert kinds.count(("reduce_scatter", "backward")) == len(layout.buffers)
    assert found[0].unit == "" and found[0].phase == "forward"  # the root is gathered first


def test_fsdp2_and_ddp_bytes_follow_the_layout_exactly(llama_spec):
    n = 4
    layout = plan(llama_spec, LayoutOptions(world_size=n))
    cfg = MemoryConfig(grad_dtype="float32")
    want = 0
    for p in place(layout, cfg):
        size = p.split.padded * torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
        times = 2 if p.unit else 1
        want += (n - 1) * size * times + (n - 1) * p.split.padded * 4  # reduce in float32
    assert sent_bytes(collectives(layout, "fsdp2", cfg)) == want
    grads = sum(e.numel * 4 for b in layout.buffers for e in b.entries)
    ddp = collectives(layout, "ddp", cfg)
    assert {c.kind for c in ddp} == {"all_reduce"}
    assert sum(c.bytes for c in ddp) == grads
    assert sent_bytes(ddp) == sum(2 * (n - 1) * -(-c.bytes // n) for c in ddp)
    assert collectives(plan(llama_spec, LayoutOptions(world_size=1)), "yafsdp") == ()


def test_an_unknown_scheme(llama_spec):
    with pytest.raises(YafsdpError, match="scheme 'zero4' is not one of yafsdp|fsdp2|ddp"):
        collectives(plan(llama_spec, LayoutOptions(world_size=2)), "zero4")


def test_ring_time_on_the_node_and_beyond():
    cluster = Cluster(inter_node_bytes_per_s=50e9, intra_latency_s=5e-6, inter_latency_s=1e-5)
    # 4 ranks on one node: 3/4 x 4 GB / 100 GB/s + 3 x 5 us
    assert ring_time("all_gather", 4e9, 4, GPU, cluster) == pytest.approx(0.03 + 15e-6)
    assert ring_time("all_reduce", 4e9, 4, GPU, cluster) == pytest.approx(2 * (0.03 + 15e-6))
    # 16 ranks, two nodes of 8, hierarchical: across the nodes each GPU sends its rail's
    # 1 other shard of 4 GB / 16 through its own NIC (1/16 x 4 GB / 50 GB/s + 1 x 10 us),
    # then within the node a ring of 8 (7/8 x 4 GB / 100 GB/s + 7 x 5 us)
    assert ring_time("reduce_scatter", 4e9, 16, GPU, cluster) == pytest.approx(
        0.005 + 1e-5 + 0.035 + 35e-6
    )
    # 64 ranks, 8 nodes: 7/64 x 4 GB / 50 GB/s + 7 x 10 us, and the same node ring
    assert ring_time("all_gather", 4e9, 64, GPU, cluster) == pytest.approx(
        0.004375 * 2 + 7e-5 + 0.035 + 35e-6
    )
    assert ring_time("all_reduce", 4e9, 64, GPU, cluster) == pytest.approx(
        2 * (0.00875 + 7e-5 + 0.035 + 35e-6)
    )
    # the NIC bounds the inter-node part only: a slower network moves it alone
    slow = Cluster(inter_node_bytes_per_s=25e9, intra_latency_s=5e-6, inter_latency_s=1e-5)
    assert ring_time("all_gather", 4e9, 64, GPU, slow) == pytest.approx(
        0.0175 + 7e-5 + 0.035 + 35e-6
    )
    assert ring_time("all_gather", 4e9, 1, GPU, cluster) == 0


def test_a_scheme_and_its_timing_key_give_the_same_collectives(llama_spec):
    layout = plan(llama_spec, LayoutOptions(world_size=4))
    assert [s.timing_key for s in timed()] == ["yafsdp", "fsdp2", "ddp"]
    for scheme in (FLAT, FSDP2, DDP):
        assert collectives(layout, scheme) == collectives(layout, scheme.timing_key)


def test_a_scheme_without_collectives_is_refused(llama_spec):
    with pytest.raises(YafsdpError, match=r"scheme 'zero1' is not one of yafsdp\|fsdp2\|ddp"):
        collectives(plan(llama_spec, LayoutOptions(world_size=2)), ZERO1)
