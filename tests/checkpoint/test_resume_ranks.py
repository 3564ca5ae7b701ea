"""A sharded run resumed from a resharded checkpoint on real gloo ranks, bit for bit.

3 AdamW steps on 4 ranks, each rank saving its own file (``save_sharded_training``);
``yafsdp reshard`` to 3 ranks (a sharded set) and to 1 (a single file); 3 more steps
on 3 ranks and on 1, each rank loading its own part (``sharded_adamw``); and a run
started on 1 rank resumed on 2. Every rank's loss at every step, and the final
weights, ``exp_avg``, ``exp_avg_sq`` and step counts of the saved sets, equal the
one-process reference of the same schedule (``resume_ranks``: per step the global
batch split into that step's ranks' rows, the rows' gradients summed in rank order,
AdamW over whole flat buffers, no checkpoint) with ``torch.equal``. The references of
the 4-then-3 and 4-then-1 runs differ from step 4 on: a sum over 4 sub-batches and
one over 3 round differently, so the reference follows the schedule. A
mixed-precision run (bfloat16 weights, float32 masters) resumes from 2 ranks on 3
the same way, its masters included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.resume_ranks import HYPER, Leg, launch, reference, seeded_model
from yafsdp_cli import CheckpointError, convert_module, plan, spec_from_module
from yafsdp_cli.checkpoint import INDEX_NAME, open_flat, reshard_checkpoint
from yafsdp_cli.checkpoint.flat_training import (
    adamw_extras,
    flat_adamw,
    read_buffer,
    save_flat_training,
)
from yafsdp_cli.checkpoint.sharded_training import save_sharded_training, sharded_adamw
from yafsdp_cli.cli import app
from yafsdp_cli.engine.sharded import LocalComm, ShardedFlat
from yafsdp_cli.options import LayoutOptions

STEPS = 3  # before the break, and after it


@pytest.fixture(scope="module")
def on4(tmp_path_factory) -> tuple[Path, list]:
    """3 steps on 4 ranks, saved per rank: the set's folder and every rank's losses."""
    tmp = tmp_path_factory.mktemp("resume")
    losses = launch(Leg(4, 0, STEPS, None, str(tmp / "run4")), tmp / "launch4")
    return tmp / "run4", losses


def assert_losses(got: list, ref, first: int) -> None:
    """``got[rank][i]`` is the reference's loss of rank ``rank`` at step ``first + i``."""
    assert all(not isinstance(r, str) for r in got), got
    for i in range(len(got[0])):
        want = ref.losses[first + i]
        assert len(want) == len(got)
        for rank, losses in enumerate(got):
            assert torch.equal(losses[i], want[rank]), (first + i, rank)


def assert_saved(path: Path, ref, after: int) -> None:
    """The checkpoint at ``path`` holds the reference's buffers and AdamW state after
    step ``after`` bit for bit, with zero padding, for its own world size."""
    ckpt = open_flat(path)
    assert ckpt.verify() == sum(len(f) for f in ckpt.files)  # checksums, zero padding
    assert {b.name for b in ckpt.all_buffers} == set(ref.saved[after])
    for b in ckpt.all_buffers:
        got, want = read_buffer(ckpt, b), ref.saved[after][b.name]
        assert torch.equal(got[: b.end], want[: b.end]), b.name
        assert not got[b.end :].any() and not want[b.end :].any()
    extras = adamw_extras(ckpt)
    for b in ckpt.layout.buffers:
        step = extras[("optimizer", "state", b.entries[0].name, "step")]
        assert torch.equal(step, ref.steps[after])
    group = extras[("optimizer", "param_groups")][0]
    assert {k: group[k] for k in HYPER} == HYPER


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# ---------------------------------------------------------------- AdamW on shards


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_adamw_on_shards_is_the_slice_of_adamw_on_the_whole_buffer(dtype, foreach):
    """Why a rank's state is its slice of the whole buffer's: AdamW is elementwise."""
    gen = torch.Generator().manual_seed(0)
    for numel, world in [(7, 2), (100, 3), (1000, 4), (4099, 5)]:
        s = -(-numel // world)
        start = torch.randn(s * world, generator=gen).to(dtype)
        grads = [torch.randn(s * world, generator=gen).to(dtype) for _ in range(3)]
        whole = torch.nn.Parameter(start.clone())
        shards = [torch.nn.Parameter(p.clone()) for p in start.split(s)]
        opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=foreach)
                for p in [whole, *shards]]  # fmt: skip
        for g in grads:
            for p, part in zip([whole, *shards], [g, *g.split(s)]):
                p.grad = part.clone()
            for opt in opts:
                opt.step()
        assert torch.equal(torch.cat([p.detach() for p in shards]), whole.detach())
        for field in ("exp_avg", "exp_avg_sq"):
            parts = [opt.state[p][field] for opt, p in zip(opts[1:], shards)]
            assert torch.equal(torch.cat(parts), opts[0].state[whole][field])


# ---------------------------------------------------------------- real ranks


@pytest.fixture(scope="module")
def ref_4_then_3():
    return reference([4] * STEPS + [3] * STEPS, save_after=(STEPS - 1, 2 * STEPS - 1))


def test_every_rank_saves_its_own_file(on4, ref_4_then_3):
    run4, losses = on4
    assert_losses(losses, ref_4_then_3, 0)
    names = sorted(p.name for p in run4.parent.iterdir() if p.name.startswith((".", "run4")))
    assert names == ["run4"]  # no temporary left beside it
    assert sorted(p.name for p in run4.iterdir()) == sorted(
        [INDEX_NAME, *(f"rank-{r:05d}-of-00004.safetensors" for r in range(4))]
    )
    assert open_flat(run4).source == "sharded_adamw"
    assert_saved(run4, ref_4_then_3, after=STEPS - 1)


def test_resume_on_3_ranks_from_a_resharded_set(on4, ref_4_then_3, tmp_path):
    run4, _ = on4
    result = run("reshard", run4, "-n", "3", "--sharded", "-o", tmp_path / "re3")
    assert result.exit_code == 0, result.output
    leg = Leg(3, STEPS, STEPS, str(tmp_path / "re3"), str(tmp_path / "end3"))
    assert_losses(launch(leg, tmp_path / "launch"), ref_4_then_3, STEPS)
    assert_saved(tmp_path / "end3", ref_4_then_3, after=2 * STEPS - 1)


def test_resume_on_1_rank_from_a_single_file(on4, tmp_path):
    run4, _ = on4
    ref = reference([4] * STEPS + [1] * STEPS, save_after=(2 * STEPS - 1,))
    reshard_checkpoint(run4, tmp_path / "re1.safetensors", world_size=1)
    leg = Leg(1, STEPS, STEPS, str(tmp_path / "re1.safetensors"), str(tmp_path / "end1"))
    assert_losses(launch(leg, tmp_path / "launch"), ref, STEPS)
    assert_saved(tmp_path / "end1", ref, after=2 * STEPS - 1)


def test_a_run_started_on_1_rank_resumes_on_2_from_a_single_file(tmp_path):
    ref = reference([1] * STEPS + [2] * STEPS, save_after=(2 * STEPS - 1,))
    first = launch(Leg(1, 0, STEPS, None, str(tmp_path / "run1")), tmp_path / "launch1")
    assert_losses(first, ref, 0)
    reshard_checkpoint(tmp_path / "run1", tmp_path / "re2.safetensors", world_size=2)
    leg = Leg(2, STEPS, STEPS, str(tmp_path / "re2.safetensors"), str(tmp_path / "end2"))
    assert_losses(launch(leg, tmp_path / "launch2"), ref, STEPS)
    assert_saved(tmp_path / "end2", ref, after=2 * STEPS - 1)


def test_a_mixed_precision_run_resumes_with_its_masters(tmp_path):
    """bfloat16 weights, float32 masters: 2 steps on 2 ranks, resharded to 3, 2 more;
    losses, weights, masters and moments as the one-process reference's."""
    ref = reference([2, 2, 3, 3], save_after=(1, 3), masters=True)
    first = launch(Leg(2, 0, 2, None, str(tmp_path / "run2"), masters=True), tmp_path / "l2")
    assert_losses(first, ref, 0)
    assert_saved(tmp_path / "run2", ref, after=1)
    assert open_flat(tmp_path / "run2").optim.masters == "master_param"
    reshard_checkpoint(tmp_path / "run2", tmp_path / "re3", world_size=3, sharded=True)
    leg = Leg(3, 2, 2, str(tmp_path / "re3"), str(tmp_path / "end3"), masters=True)
    assert_losses(launch(leg, tmp_path / "l3"), ref, 2)
    assert_saved(tmp_path / "end3", ref, after=3)


def test_a_rank_that_fails_to_load_stops_every_rank(on4, tmp_path):
    """Rank 1's file is corrupt: rank 0 reads its own file fine, yet both raise rank 1's
    error rather than leave rank 0 waiting in the first gather of the step."""
    run4, _ = on4
    reshard_checkpoint(run4, tmp_path / "re2", world_size=2, sharded=True)
    rank1 = tmp_path / "re2" / "rank-00001-of-00002.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor's data
    rank1.write_bytes(bytes(data))
    leg = Leg(2, STEPS, 1, str(tmp_path / "re2"), str(tmp_path / "never"))
    got = launch(leg, tmp_path / "launch")
    assert got[0] == got[1] and got[0].startswith("rank 1: ") and "fails its checksum" in got[0]
    assert not (tmp_path / "never").exists()


# ---------------------------------------------------------------- bad input, one process


def sharded_gpt(world: int, rank: int = 0, layout=None, units=None) -> ShardedFlat:
    model = seeded_model()
    layout = layout or plan(spec_from_module(model), LayoutOptions(world_size=world, units=units))
    return ShardedFlat(convert_module(model, layout), LocalComm(rank, world))


@pytest.fixture(scope="module")
def saved4(tmp_path_factory) -> Path:
    """A 4-rank set with AdamW state, written by one process (``save_flat_training``)."""
    model = seeded_model()
    flat = convert_module(model, plan(spec_from_module(model), LayoutOptions(world_size=4)))
    opt = flat_adamw(flat, **HYPER)
    model(torch.randint(0, 256, (2, 8))).square().mean().backward()
    opt.step()
    out = tmp_path_factory.mktemp("saved") / "run4"
    save_flat_training(flat, opt, out, sharded=True)
    return out


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def rank_slice(ckpt, name: str, rank: int) -> torch.Tensor:
    b = next(b for b in ckpt.all_buffers if b.name == name)
    return read_buffer(ckpt, b, rank * b.shard_numel, (rank + 1) * b.shard_numel)  # (s,)


def test_a_rank_loads_its_slice_of_a_one_process_checkpoint(saved4):
    ckpt = open_flat(saved4)
    for rank in range(4):
        sharded = sharded_gpt(4, rank, ckpt.layout)
        opt = sharded_adamw(sharded, ckpt)
        for b, shard in zip(ckpt.layout.buffers, sharded.shards):
            assert torch.equal(shard.detach(), rank_slice(ckpt, b.name, rank))
            for field in ("exp_avg", "exp_avg_sq"):
                want = rank_slice(ckpt, f"{b.name}@{field}", rank)
                assert torch.equal(opt.state[shard][field], want)


def test_a_weights_only_checkpoint_is_refused(tmp_path):
    from yafsdp_cli.checkpoint import convert_checkpoint

    convert_checkpoint(
        "sample_models/gpt.safetensors", tmp_path / "w", LayoutOptions(world_size=4), sharded=True
    )
    with pytest.raises(CheckpointError) as exc:
        sharded_adamw(sharded_gpt(4), tmp_path / "w")
    assert "holds no AdamW state (weights only)" in one_line(exc)


def test_another_world_size_is_refused_naming_reshard(saved4):
    with pytest.raises(CheckpointError) as exc:
        sharded_adamw(sharded_gpt(3), saved4)
    text = one_line(exc)
    assert "is laid out for 4 ranks, but 3 run; reshard it first: yafsdp reshard" in text
    assert f"{saved4} -n 3 --sharded" in text


def test_another_layout_is_refused(saved4):
    with pytest.raises(CheckpointError) as exc:
        sharded_adamw(sharded_gpt(4, units=["transformer.h.0"]), saved4)  # 2 buffers, not 3
    assert "the module was converted with another layout than the checkpoint's" in one_line(exc)


def test_saving_refuses_an_existing_output_and_a_simulated_rank(saved4, tmp_path):
    sharded = sharded_gpt(1)
    opt = sharded_adamw(sharded, **HYPER)
    with pytest.raises(CheckpointError) as exc:
        save_sharded_training(sharded, opt, saved4)
    assert "exists" in one_line(exc)
    with pytest.raises(CheckpointError) as exc:
        save_sharded_training(sharded, opt, tmp_path / "early")  # before any step
    assert "not AdamW's step, exp_avg and exp_avg_sq" in one_line(exc)
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    alone = sharded_gpt(4, 1, open_flat(saved4).layout)
    with pytest.raises(CheckpointError) as exc:
        save_sharded_training(alone, sharded_adamw(alone, saved4), tmp_path / "x")
    assert "needs every rank's file" in one_line(exc)
