"""FSDP2's and DDP's own fake steps (``engine_step``): what ``plan --scheme`` builds its
rows from, checked against the engines' own traces (the real engines on gloo:
``tests/planning/test_plan_scheme_truth.py``).

- An FSDP2 step traced on one rank and rewritten to another world size and rank is
  the step traced there, event for event (``rank_sizes``), on a Qwen3-MoE whose 5
  experts split unevenly, with CUDA's kernels and bfloat16 masters too.
- One period traced and repeated gives the whole trace's figures, for every engine
  and the unwrapped step, with and without checkpointing.
- DDP's buckets written for the whole model are the ones DDP itself rebuilds (a real
  model on real tensors, the fake process group); its step is the same at every
  world size and rank.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tests.fsdp2_ranks import CONFIGS  # noqa: E402
from yafsdp_cli.errors import YafsdpError  # noqa: E402
from yafsdp_cli.memory.caching_allocator import reserved_of  # noqa: E402
from yafsdp_cli.options import LayoutOptions, MemoryOptions, StepOptions  # noqa: E402
from yafsdp_cli.options.alloc_conf import allocator_setting  # noqa: E402
from yafsdp_cli.profiling import ProfileOptions  # noqa: E402
from yafsdp_cli.profiling.ddp_engine import DdpEngine, _hook, bucket_sizes  # noqa: E402
from yafsdp_cli.profiling.engine_step import (  # noqa: E402
    Unwrapped,
    engine_step,
    fake_process_group,
    traced_step,
)
from yafsdp_cli.profiling.fsdp2_engine import Fsdp2Engine  # noqa: E402
from yafsdp_cli.profiling.periodic import canonical, first_difference  # noqa: E402
from yafsdp_cli.profiling.rank_sizes import RankTraces, at_rank, rank_groups  # noqa: E402
from yafsdp_cli.profiling.shard_sizes import RecordedStep  # noqa: E402
from yafsdp_cli.sources import load_source  # noqa: E402

pytestmark = pytest.mark.hf
CPU = ("float32", "cpu")
CUDA = ("bfloat16", "cuda")  # CUDA's attention kernels, 512-byte rounding, masters


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe")
    CONFIGS["qwen3moe"]().save_pretrained(folder)
    return load_source(folder)


def _opts(ws: int, kind=CPU, checkpointing="none", periodic=True) -> ProfileOptions:
    dtype, target = kind
    step = StepOptions(
        batch=2, seq_len=16, target=target, param_dtype=dtype, optimizer_impl="foreach",
        checkpointing=checkpointing,
    )  # fmt: skip
    return ProfileOptions(
        layout=LayoutOptions(world_size=ws), step=step, memory=MemoryOptions(), fake=True,
        periodic=periodic,
    )  # fmt: skip


def _same(a, b) -> str | None:
    """None where two steps' events are the same, blocks numbered as first sized."""
    x, y = RecordedStep(a, None), RecordedStep(b, None)
    return None if canonical(x)[:2] == canonical(y)[:2] else first_difference(x, y)


def _figures(events):
    t = events.replay()
    reserved = reserved_of(events.alloc_trace(), allocator_setting(None)).reserved_peak
    return t.peak, t.phase_peaks, t.phase_breakdowns, t.end, reserved


def test_ranks_of_an_uneven_split_are_grouped_by_the_rows_they_own():
    assert rank_groups((5, 32), 2) == ((0, 0), (1, 1))  # 3 experts, then 2
    assert rank_groups((5, 32), 4) == ((0, 1), (2, 2), (3, 3))  # 2, 2, 1, 0
    assert rank_groups((64, 32), 4) == ((0, 3),)
    assert rank_groups((8192, 32000), 512) == ((0, 506), (507, 507), (508, 511))  # a vocab


@pytest.mark.parametrize("kind", [CPU, CUDA], ids=["cpu", "cuda-bf16"])
def test_an_fsdp2_rank_rewritten_is_the_rank_traced(qwen, kind):
    """Traced on rank 0 of 2 and rewritten, event for event, to ranks that own other
    rows (a rank with no expert at all among them) at other world sizes."""
    base = traced_step(qwen, _opts(2, kind), Fsdp2Engine(), 0, 3)
    assert base.ranks is not None and base.ranks.clean and base.ranks.rules
    for ws, rank in ((2, 1), (4, 3)):
        direct = traced_step(qwen, _opts(ws, kind), Fsdp2Engine(), rank, 3)
        written = at_rank(base, ws, rank)
        assert _same(written, direct.events) is None, (ws, rank, _same(written, direct.events))
        # the allocator's trace written straight from the step's own is the same replay
        trace = RankTraces(base).at(ws, rank)
        conf = allocator_setting(None)
        assert reserved_of(trace, conf) == reserved_of(written.alloc_trace(), conf)
    assert at_rank(base, 1, 0) is None  # world size 1 runs another path


def test_ranks_that_own_fewer_experts_peak_lower(qwen):
    step = engine_step(qwen, _opts(2), Fsdp2Engine(), 0).step
    peaks = [at_rank(step, 4, r).replay().peak.total for r in range(4)]
    assert peaks[0] == peaks[1] > peaks[2] > peaks[3], peaks


@pytest.mark.parametrize(
    ("engine", "checkpointing", "kind"),
    [
        (Fsdp2Engine(), "none", CUDA),
        (Fsdp2Engine(reshard_after_forward=False), "non-reentrant", CPU),
        (DdpEngine(), "non-reentrant", CUDA),
        (Unwrapped(), "none", CPU),
    ],
    ids=["fsdp2-cuda", "fsdp2-kept-nonreentrant", "ddp-nonreentrant-cuda", "unwrapped"],
)
def test_one_period_repeated_is_the_whole_trace(qwen, engine, checkpointing, kind):
    got = engine_step(qwen, _opts(2, kind, checkpointing), engine, 0)
    whole = engine_step(qwen, _opts(2, kind, checkpointing, periodic=False), engine, 0)
    assert got.how.periodic and got.sound, got.how.why
    assert not whole.how.periodic and whole.sound
    assert _figures(got.step.events) == _figures(whole.step.events)


def test_an_unchecked_period_is_said_so_and_gives_the_checked_figures(qwen):
    checked = engine_step(qwen, _opts(2), Fsdp2Engine(), 0)
    alone = engine_step(qwen, _opts(2), Fsdp2Engine(), 0, checked=False)
    assert alone.how.traced_layers == (3,) and "unchecked" in alone.how.why
    assert _figures(alone.step.events) == _figures(checked.step.events)


def test_ddp_steps_alike_at_every_world_size_and_rank(qwen):
    steps = [traced_step(qwen, _opts(ws), DdpEngine(), r, None) for ws, r in ((2, 0), (4, 3))]
    assert _same(steps[0].events, steps[1].events) is None


def test_ddp_buckets_are_the_ones_ddp_rebuilds():
    """A real model on real tensors under DDP and the fake group: after its first
    backward DDP rebuilds its buckets in the order gradients became ready; the plan
    writes the same sizes from that order (several buckets: 1 MiB first, 25 MiB)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)], nn.Linear(1024, 3))
    seen, order = [], []
    with fake_process_group(2, 0):
        ddp = nn.parallel.DistributedDataParallel(model, init_sync=False)
        allreduce = _hook(2)

        def hook(state, bucket):
            seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return allreduce(state, bucket)

        ddp.register_comm_hook(None, hook)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(order.append)
        x = torch.randn(4, 1024)
        for _ in range(2):  # the rebuild happens in the second forward
            seen.clear()
            order.clear()
            ddp(x).sum().backward()
            model.zero_grad(set_to_none=True)
    assert len(seen) > 1
    assert bucket_sizes([(p.numel(), p.dtype) for p in order], None) == seen


def test_the_unwrapped_step_is_the_profilers_original_step(qwen):
    from yafsdp_cli.profiling.profiler import profile_model

    got = engine_step(qwen, _opts(1, periodic=False), Unwrapped(), 0)
    report = profile_model(qwen, _opts(1, periodic=False))
    assert got.step.events.replay().peak.total == report.original.peak.total


def test_a_process_group_already_made_is_one_error():
    with (
        fake_process_group(2, 0),
        pytest.raises(YafsdpError, match="torch.distributed is already initialized"),
        fake_process_group(2, 1),
    ):
        pass
