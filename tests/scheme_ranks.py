"""The rank side of the scheme truth harness (``test_plan_scheme_truth.py``).

Each rank trains a tiny transformers model for a few steps under a real engine over
gloo, ``fully_shard`` (every decoder block, then the root) or
``DistributedDataParallel``, with foreach AdamW, and measures the third (of
``grad_accum`` micro-batches, gradient sync on in each or only in the last) with
the profiler's ``StorageTracker``: every storage the step's ops make, when it is
freed, and ``resize_`` (FSDP2 frees and refills its unsharded parameters that way).
A warm-up step comes first, and creates the optimizer states (the plan's fake step
warms its optimizer up too); DDP takes a second, in whose forward it rebuilds its
buckets in the order gradients became ready. What exists before the measured step
(shards or whole parameters, optimizer states, DDP's buckets) is registered first,
so the peak counts everything the rank holds.

gloo's worker thread keeps a collective's tensors until it drops its work, a moment
after the rank has already moved on, and so frees them at a point of the step that
changes from run to run (a whole unit's all-gather output, now and then, at the
peak). ``settled_collectives`` hands gloo private copies made out of the tracker's
sight: every storage the engine makes is then freed where the engine drops it,
and the measured peak is the engine's schedule, the same in every run.

Launched by ``fsdp2_ranks.launch`` (ranks forked from a forkserver that has imported
torch and transformers once).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes

from tests.fsdp2_ranks import blocks, build, serve_rank
from yafsdp_cli.engine.idioms import apply_checkpointing
from yafsdp_cli.engine.train_step import step_loss
from yafsdp_cli.profiling.tracker import StorageTracker, op_tensors


@dataclass(frozen=True)
class StepJob:
    scheme: str  # "fsdp2" or "ddp"
    model: str  # a key of fsdp2_ranks.CONFIGS
    batch: int
    seq_len: int
    reshard_after_forward: bool = True
    # the measured step's micro-batches; gradient sync (FSDP2's
    # set_requires_gradient_sync, DDP's no_sync) off until the last one where False
    grad_accum: int = 1
    sync: bool = True
    # "model": the model's own cross-entropy (labels = the inputs); "plan": the fake
    # step's loss (``train_step.step_loss``), so the two steps differ by the engine alone
    loss: str = "model"
    checkpointing: str = "none"  # as the plan applies it (``idioms.apply_checkpointing``)


@dataclass(frozen=True)
class StepPeak:
    peak: int  # bytes alive at the step's highest moment
    phase: str
    phase_peaks: dict
    stray_frees: int  # tracked storages freed off the rank's main thread (0 expected)


class LocalStorages(StorageTracker):
    """The tracker, seeing a DTensor's local storage: FSDP2's sharded parameters and
    the optimizer's states of them are DTensors, whose wrapper has no storage."""

    stray_frees = 0

    def _freed(self, i, ref):
        if threading.current_thread() is not threading.main_thread() and not self._closed:
            self.stray_frees += 1
        super()._freed(i, ref)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in op_tensors(out if isinstance(out, (list, tuple)) else (out,)):
            self._see(_local(t).untyped_storage())
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _wrap(model: torch.nn.Module, job: StepJob) -> torch.nn.Module:
    if job.scheme == "fsdp2":
        for block in blocks(model):
            fully_shard(block, reshard_after_forward=job.reshard_after_forward)
        fully_shard(model, reshard_after_forward=job.reshard_after_forward)
        return model
    return DistributedDataParallel(model)  # bucket_cap_mb=25, gradient_as_bucket_view=False


def _keeping_buckets(kept: list):
    """DDP's own allreduce, as a comm hook that also keeps each bucket's tensor: the
    reducer makes them in C++, out of the tracker's sight, and this is where they
    can be seen."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        kept.append(bucket.buffer())
        return allreduce_hook(None, bucket)

    return hook


def private_copies(collective):
    """``collective(output, input, ...)`` (positional, or by the keywords torch and
    DeepSpeed use) run on untracked copies of both tensors and waited for; the
    result is copied into ``output``. The returned work (if the caller asked for
    one) has finished and holds only the copies."""

    def run(*args, **kwargs):
        rest = list(args)
        output = _take(rest, kwargs, ("output_tensor", "output"))
        input = _take(rest, kwargs, ("input_tensor", "input"))
        with _disable_current_modes():
            out, inp = torch.empty_like(output), input.clone()
            work = collective(out, inp, *rest, **kwargs)
            if work is not None:
                work.wait()
            output.copy_(out)
        return work

    return run


def _take(args: list, kwargs: dict, names: tuple[str, ...]):
    """The argument given by one of ``names``, else the first positional one."""
    for name in names:
        if name in kwargs:
            return kwargs.pop(name)
    return args.pop(0)


def private_in_place(collective):
    """``collective(tensor, ...)`` (an all-reduce or broadcast in place) run on an
    untracked copy, waited for, and copied back."""

    def run(tensor, *args, **kwargs):
        with _disable_current_modes():
            copy = tensor.clone()
            work = collective(copy, *args, **kwargs)
            if work is not None:
                work.wait()
            tensor.copy_(copy)
        return work

    return run


def _private_broadcast(broadcast):
    """``dist._broadcast_coalesced(group, tensors, ...)`` (DDP's buffer broadcast at
    each forward) on untracked copies, copied back."""

    def run(group, tensors, *args):
        with _disable_current_modes():
            copies = [t.clone() for t in tensors]
            broadcast(group, copies, *args)
            for t, c in zip(tensors, copies, strict=True):
                t.copy_(c)

    return run


# what FSDP2 and DDP call, each looked up on ``torch.distributed`` at every call
ENGINE_COLLECTIVES = {
    "all_gather_single": private_copies,
    "reduce_scatter_single": private_copies,
    "_broadcast_coalesced": _private_broadcast,
}


@contextlib.contextmanager
def settled_collectives(wrappers: dict = ENGINE_COLLECTIVES, owner=dist):
    """``owner``'s collectives named in ``wrappers`` through private copies."""
    saved = {n: getattr(owner, n) for n in wrappers}
    for n, wrap in wrappers.items():
        setattr(owner, n, wrap(saved[n]))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(owner, n, f)


def run_step(job: StepJob) -> StepPeak:
    with settled_collectives():
        return _run_step(job)


def _loss(wrapped, ids, job: StepJob):
    if job.loss == "plan":
        return step_loss(wrapped(input_ids=ids, use_cache=False), 0)
    return wrapped(input_ids=ids, labels=ids).loss


def _run_step(job: StepJob) -> StepPeak:
    torch.manual_seed(0)
    model = build(job.model)
    if job.checkpointing != "none":
        apply_checkpointing(model, job.checkpointing, ())
    wrapped = _wrap(model, job)
    buckets: list[torch.Tensor] = []
    if job.scheme == "ddp":
        wrapped.register_comm_hook(None, _keeping_buckets(buckets))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (job.batch, job.seq_len), generator=gen)
    for _ in range(2 if job.scheme == "ddp" else 1):  # optimizer states; DDP's rebuild
        buckets.clear()
        _loss(wrapped, ids, job).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracker = LocalStorages(1)
    tracker.assign(list(buckets), "gradients")
    buckets.clear()
    params = [_local(p) for p in model.parameters()]
    tracker.assign(params, "parameters")
    states = [_local(v) for s in opt.state.values() for k, v in s.items() if k != "step"]
    tracker.assign(states, "optimizer")
    tracker.assign([ids], "activations")
    with tracker:
        for m in range(job.grad_accum):
            with _sync(wrapped, job, last=m == job.grad_accum - 1):
                tracker.set_phase("forward")
                loss = _loss(wrapped, ids, job)
                tracker.set_phase("backward")
                loss.backward()
                del loss
        tracker.assign(
            [_local(p.grad) for p in model.parameters() if p.grad is not None], "gradients"
        )
        tracker.set_phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
    timeline = tracker.replay()
    return StepPeak(
        timeline.peak.total, timeline.peak_phase, dict(timeline.phase_peaks), tracker.stray_frees
    )


def _sync(wrapped, job: StepJob, last: bool):
    """Gradient sync for one micro-batch: on where the job syncs every micro-batch or
    this is the last; else DDP's ``no_sync()``, FSDP2's sync switched off."""
    on = job.sync or last
    if job.scheme == "ddp":
        return contextlib.nullcontext() if on else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(on)
    return contextlib.nullcontext()


def rank_main(rank: int, world: int, tmp: str, jobs: list[StepJob]) -> None:
    serve_rank(rank, world, tmp, jobs, run_step)
