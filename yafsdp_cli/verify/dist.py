"""``yafsdp verify --world-size N``: the check on N real ``torch.distributed`` ranks.

Launching. ``run_world`` starts N processes itself (``torch.multiprocessing``,
spawn; a file store in a private temporary folder, so no port can be taken by
someone else; gloo on CPU, NCCL with ``--device cuda``); each loads the source on
its own, and rank 0 hands the report back. Under ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the command runs as that one
rank instead, and rank 0 prints::

    torchrun --nproc-per-node 2 --no-python yafsdp verify SOURCE --world-size 2

What every rank does, per step (see ``sharded.ShardedFlat`` for the runtime):

1. the reference: the *original* module, whole, runs every rank's micro-batches in
   one process; for each micro-batch the per-rank gradients are summed in rank
   order, and those sums accumulated over micro-batches, which is the order the
   sharded run sums in (a different order changes the last bit, which is why it
   is fixed);
2. the converted module with only this rank's shards runs this rank's
   micro-batches: gather before each unit's forward, reduce-scatter (all-to-all
   plus an in-order sum) after each backward, and steps its optimizer on its
   shards;
3. outputs are compared on each rank; gradients and parameters are all-gathered
   from the shards and compared with the reference by name; after the last step
   each rank measures the storages it keeps.

Every rank pins its numerics (``numerics``) and keeps its reference run on disk;
on a mismatch every rank re-runs the reference from its starting values and
compares it bit for bit with the first run (``recheck``), and the report says
"not reproducible" if any rank's reference drifted.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import tempfile
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..engine.flat import convert_module
from ..engine.sharded import DistComm, ShardedFlat, mirror_graph_breaks
from ..engine.train_step import forward_backward, make_optimizer, optimizer_tensors
from ..errors import YafsdpError
from .harness import (
    Prepared,
    Recorder,
    VerifyOptions,
    VerifyReport,
    allocation_rounding,
    batch_for,
    build_report,
    held_bytes,
    micro_seed,
    named_params,
    prepare,
    rank_memory,
    resolve_tolerances,
    with_idioms,
    with_world_size,
)
from .numerics import apply, pinned
from .recheck import START, first_drift, put_back, starting_values, with_recheck
from .store import ReferenceStore

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = timedelta(minutes=5)
SGD_NOTE = (
    "SGD on bfloat16/float16 buffers: torch's CPU kernel for add(..., alpha) rounds the last "
    "few elements of a tensor (its scalar tail) differently, so a shard boundary inside a "
    "parameter can change the last bit of an update, and later steps amplify it; AdamW and "
    "Adam have no such tail; shards and parameters whose sizes are multiples of 64 elements "
    "avoid it"
)
COMPILE_NOTE = (
    "--compile on several ranks: each unit stays gathered from its forward to the end of "
    "backward (FSDP2's reshard_after_forward=False), since a compiled backward reads its "
    "parameters before a per-unit hook could gather them again; the original gets the "
    "same graph breaks (an eager hook per unit), so both compile to the same graphs"
)
BUFFERS_NOTE = (
    "module buffers (BatchNorm statistics) are not compared across ranks: each rank "
    "updates its own from its own micro-batches"
)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV) and int(os.environ["WORLD_SIZE"]) > 1


def torchrun_rank(source, model, trust_pickle, opts: VerifyOptions) -> VerifyReport:
    """Run as the rank torchrun started; every rank returns the same report."""
    from ..sources import load_source

    world = int(os.environ["WORLD_SIZE"])
    if opts.layout.world_size not in (1, world):
        raise YafsdpError(
            f"--world-size {opts.layout.world_size} but torchrun started {world} ranks; "
            "give the same number (or leave --world-size out)"
        )
    opts = with_world_size(opts, world)
    _init(int(os.environ["RANK"]), world, "env://", opts.step.device)
    try:
        report = verify_this_rank(load_source(source, model=model, trust_pickle=trust_pickle), opts)
        dist.barrier()  # nobody tears the group down while another rank still uses it
        return report
    finally:
        leave_group()


def leave_group() -> None:
    """``destroy_process_group``: with ``_init``'s early dynamo import, the group's C++
    object, and its gloo threads, end here rather than in the interpreter's exit."""
    dist.destroy_process_group()


def is_primary() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run_world(jobs: list[tuple]) -> list[VerifyReport]:
    """Verify each ``(source, model, trust_pickle, opts)`` on ``opts.layout.world_size`` new
    processes (one launch for all jobs, so several models cost one start-up)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    world = jobs[0][3].layout.world_size
    if any(job[3].layout.world_size != world for job in jobs):
        raise YafsdpError("run_world: every job must have the same world size")
    # torch logs a warning line per rank it stops after another died: the one
    # error line below says what happened
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="yafsdp-verify-") as tmp:
        try:
            mp.start_processes(
                _worker, args=(world, tmp, jobs), nprocs=world, join=True, start_method="spawn"
            )
        except ProcessException as exc:
            # every rank has finished its collectives before rank 0 writes the result,
            # so a rank dying while it shuts down loses nothing
            done = (Path(tmp) / "result.pkl").exists() and not any(Path(tmp).glob("error.*"))
            if not done:
                raise YafsdpError(_first_error(Path(tmp), exc)) from None
        with open(Path(tmp) / "result.pkl", "rb") as f:
            return pickle.load(f)  # written by our own rank 0 just now


def _worker(rank: int, world: int, tmp: str, jobs: list[tuple]) -> None:
    from ..sources import load_source

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        _init(rank, world, f"file://{tmp}/store", jobs[0][3].step.device)
        reports = [
            verify_this_rank(load_source(src, model=model, trust_pickle=trust), opts)
            for src, model, trust, opts in jobs
        ]
        if rank == 0:
            part = Path(tmp) / "result.part"
            part.write_bytes(pickle.dumps(reports))
            part.rename(Path(tmp) / "result.pkl")
        dist.barrier()  # nobody tears the group down while another still uses it
    except BaseException as exc:  # noqa: BLE001 - one line for the parent, then exit
        what = str(exc) if isinstance(exc, YafsdpError) else f"{type(exc).__name__}: {exc}"
        (Path(tmp) / f"error.{rank}").write_text(what)
        if os.environ.get("YAFSDP_DEBUG"):
            import traceback

            traceback.print_exc()
        raise SystemExit(3) from None
    finally:
        if dist.is_initialized():
            leave_group()


def _first_error(tmp: Path, exc: Exception) -> str:
    signal_name = getattr(exc, "signal_name", None)
    if signal_name:  # killed (out of memory, kill -9): the cause, whatever the others say
        return (
            f"rank {exc.error_index} of the verify run died (signal {signal_name}); the "
            "other ranks were stopped. Out of memory? Rerun with fewer ranks"
        )
    errors = sorted(tmp.glob("error.*"), key=lambda p: int(p.suffix[1:]))
    if errors:
        rank = errors[0].suffix[1:]
        return f"rank {rank} of the verify run failed: {errors[0].read_text()}"
    return f"a verify rank died ({exc}); rerun with --debug, or with fewer ranks"


def _init(rank: int, world: int, init_method: str, device: str) -> None:
    # Dynamo must be imported before the group exists. Imported later (torch imports
    # it lazily, e.g. for the first random fill of a meta tensor when an architecture
    # is built), it keeps a reference to the default group that outlives
    # destroy_process_group (torch 2.13), so the group and its gloo worker threads
    # were freed only by the interpreter's exit, where a thread taking the GIL is
    # ended by a forced unwind: "terminate called without an active exception",
    # SIGABRT, about 1 torchrun launch in 12 under load. (gdb: a pt_gloo_runloop
    # thread, the main thread in Py_FinalizeEx; tests/verify/test_verify_dist.py counts the
    # threads left after the group is destroyed.)
    import torch._dynamo  # noqa: F401

    backend = "gloo"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise YafsdpError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT
    )


def verify_this_rank(loaded, opts: VerifyOptions) -> VerifyReport:
    """This process's part of a running distributed verify; the same report on every rank."""
    if not dist.is_initialized():
        raise YafsdpError(
            f"world size {opts.layout.world_size} in one process: use verify_source (it launches "
            "the ranks) or start the ranks with torchrun"
        )
    comm = DistComm()
    if comm.world_size != opts.layout.world_size:
        raise YafsdpError(f"--world-size {opts.layout.world_size}, but {comm.world_size} ranks run")
    return run_rank(prepare(loaded, opts), opts, comm)


def run_rank(prep: Prepared, opts: VerifyOptions, comm: DistComm) -> VerifyReport:
    with pinned() as pins, ReferenceStore() as store:
        report, run = _run_rank(prep, opts, comm, store)
        if report.failures:
            apply(pins.threads)
            drift = recheck_reference(prep.original, run, opts, comm, store)
            report = with_recheck(report, drift)
    return replace(report, pinned=pins.describe())


def recheck_reference(original, run, opts: VerifyOptions, comm: DistComm, store):
    """Every rank runs its reference again from the starting values (``run``: the same
    callable as the first run, compiled or not) and compares it bit for bit with the
    first run; the first drift of the lowest rank that drifted (the same answer on
    every rank)."""
    put_back(original, store)
    ref_opt = make_optimizer(opts.step.optimizer, original.parameters())
    with ReferenceStore() as again:
        for step in range(opts.steps):
            _reference_and_step(original, run, ref_opt, opts, step, comm, again)
        mine = first_drift(store, again, opts.steps)
    every: list = [None] * comm.world_size
    dist.all_gather_object(every, mine)
    return next((d for d in every if d is not None), None)


def _reference_and_step(original, run, ref_opt, opts, step, comm: DistComm, store):
    """One step of the reference (every rank's micro-batches, then its optimizer),
    kept in ``store``; its gradients and this rank's outputs."""
    ref_grads, ref_outs = reference_step(original, run, opts, step, comm.rank, comm.world_size)
    _set_grads(original, ref_grads)
    if ref_opt is not None:
        ref_opt.step()
    outputs = {f"output (micro-batch {m})": out for m, out in enumerate(ref_outs)}
    parts = {"output": outputs, "gradient": ref_grads, "parameter": named_params(original)}
    store.save_step(step, {**parts, "buffer": dict(original.named_buffers())})
    original.zero_grad(set_to_none=True)
    return ref_grads, ref_outs


def _run_rank(prep: Prepared, opts: VerifyOptions, comm: DistComm, store):
    original, rank = prep.original, comm.rank
    store.save_step(START, starting_values(original))
    twin = copy.deepcopy(original)
    run_original, idiom_notes = with_idioms(original, prep.layout, opts)
    run_twin, _ = with_idioms(twin, prep.layout, opts)
    # under --compile units stay gathered through backward (see ShardedFlat)
    flat = convert_module(twin, prep.layout)
    sharded = ShardedFlat(flat, comm, reshard_after_forward=not opts.compile)
    if opts.compile:
        mirror_graph_breaks(original, prep.layout)
        idiom_notes = [*idiom_notes, COMPILE_NOTE]
    tols = resolve_tolerances(opts.step.device, opts.atol, opts.rtol)
    outputs, tensors = Recorder(tols), Recorder(tols)
    ref_opt = make_optimizer(opts.step.optimizer, original.parameters())
    opt = make_optimizer(opts.step.optimizer, sharded.parameters())
    memory = None
    for step in range(opts.steps):
        ref_grads, ref_outs = _reference_and_step(
            original, run_original, ref_opt, opts, step, comm, store
        )
        for m in range(opts.micro_batches):
            seed = micro_seed(opts, step, m, rank)
            got = forward_backward(run_twin, batch_for(original, opts, seed), seed)
            sharded.finish_backward()
            outputs.compare(
                "output", f"output (rank {rank}, micro-batch {m})", step, got, ref_outs[m]
            )
        sharded.before_step()
        tensors.compare_all("gradient", step, sharded.gathered_named("grad"), ref_grads)
        del ref_grads, ref_outs
        if opt is not None:
            opt.step()
        if step == opts.steps - 1:
            memory = _rank_memory(rank, twin, sharded, opt, prep, opts)
        tensors.compare_all(
            "parameter", step, sharded.gathered_named("param"), named_params(original)
        )
        sharded.zero_grad()
    report = _merge(prep, opts, comm, outputs, tensors, memory, idiom_notes)
    return report, run_original


def reference_step(model, run, opts: VerifyOptions, step: int, rank: int, world: int):
    """The original over every rank's micro-batches; gradients by name, and this
    rank's outputs. Per micro-batch the ranks' gradients are summed in rank order
    (``None`` as zeros, ``None`` if no rank has one), then accumulated."""
    params = list(model.parameters())
    acc: dict[int, torch.Tensor | None] = {id(p): None for p in params}
    outs = []
    for m in range(opts.micro_batches):
        parts: dict[int, list] = {id(p): [] for p in params}
        for r in range(world):
            model.zero_grad(set_to_none=True)
            seed = micro_seed(opts, step, m, r)
            out = forward_backward(run, batch_for(model, opts, seed), seed)
            if r == rank:
                outs.append(out)
            for p in params:
                parts[id(p)].append(p.grad)
        for p in params:
            total = _fold_none_as_zero(parts[id(p)], p)
            if total is not None:
                acc[id(p)] = total if acc[id(p)] is None else acc[id(p)].add_(total)
    model.zero_grad(set_to_none=True)
    by_name = {n: acc[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    return by_name, outs


def _fold_none_as_zero(grads: list, p: torch.Tensor) -> torch.Tensor | None:
    if all(g is None for g in grads):
        return None
    zeros = torch.zeros_like(p)
    acc = (grads[0] if grads[0] is not None else zeros).clone()
    for g in grads[1:]:
        acc.add_(g if g is not None else zeros)
    return acc


def _set_grads(model, by_name: dict) -> None:
    for n, p in model.named_parameters(remove_duplicate=False):
        p.grad = by_name[n]


def _rank_memory(rank, twin, sharded: ShardedFlat, opt, prep: Prepared, opts: VerifyOptions):
    every_param = list(twin.parameters())  # converted ones view freed storage: 0 bytes
    whole = [b.param for b in sharded.flat.buffers]  # freed: they must count 0 bytes
    groups = (
        [*sharded.shards, *every_param, *whole],
        [p.grad for p in sharded.parameters()],
        optimizer_tensors(opt),
        list(twin.buffers()),
    )
    r = allocation_rounding(opts.step.device)
    no_grad = frozenset(n for n, p in sharded.kept_parameters() if p.grad is None)
    return rank_memory(rank, held_bytes(groups, r), prep.layout, opts.step.optimizer, r, no_grad)


def _merge(prep, opts, comm: DistComm, outputs: Recorder, tensors: Recorder, memory, notes):
    """Every rank's outputs, rank 0's gradients and parameters (the same on every
    rank: they are gathered), every rank's memory; the same report everywhere."""
    parts: list = [None] * comm.world_size
    dist.all_gather_object(parts, (outputs, memory))
    merged = tensors
    for other, _ in parts:
        merged.merge(other)
    memories = tuple(m for _, m in parts)
    notes = [*notes, BUFFERS_NOTE]
    half = any(b.dtype in ("bfloat16", "float16") for b in prep.layout.buffers)
    if opts.step.optimizer == "sgd" and half:
        notes.append(SGD_NOTE)
    backend = dist.get_backend()
    return build_report(prep, opts, merged, memories, backend=backend, extra_notes=notes)
