"""A plan's fake runs on several cores at once.

Each job is one or a few fake steps under FakeTensorMode (``measure.Job``: a
converted step and its figures at some world sizes; ``cell_time.Count``: the
kernels of a step): seconds of Python per op, one core each, independent of the
others. ``run_steps`` runs them in this process and, with ``jobs`` above 1, in
``jobs - 1`` worker processes besides (``spawn``: a fresh interpreter, never a fork
of a process that holds torch's thread pools). A worker loads the source itself,
from what the user gave (path, ``--model``, ``--trust-pickle``), so only the job (a
small frozen value with a ``run(loaded, opts, seq_len)`` method) and its figures
cross the pipe. The jobs of a plan run in one pool: the memory steps and the
kernel counts together, so the workers start once. Jobs are taken from one queue,
the dearest first by the workers and the cheapest first by this process, so the
cores stay busy to the end. A fake step's figures do not depend on where it runs,
so the plan is the same for any ``jobs`` (``tests/planning/test_plan.py`` checks it).

The number of jobs, unless given: 1 for a model of fewer than ``PARALLEL_MODULES``
modules, whose fake runs take less than a worker takes to start (importing torch and
transformers and building the model: about 4 s on 2 cores; a 2-layer Llama's step
takes 0.3 s, a job of the 80-layer Llama-2-70B's, a step and its replays at nine
world sizes, about 1.2 s); else the cores this process may use, no more than the
runs, and no more than the memory allows, counting each worker as this process's
resident size (a worker holds what this process holds: torch, the model's
meta-device architecture and one fake step's bookkeeping).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

PARALLEL_MODULES = 200


@dataclass(frozen=True, slots=True)
class Origin:
    """What rebuilds the source in a worker: ``load_source``'s arguments."""

    source: str | None
    model: str | None
    trust_pickle: bool


def auto_jobs(runs: int, modules: int) -> int:
    from ..verify.budget import available_memory, process_rss

    if modules < PARALLEL_MODULES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    per_job = max(process_rss(), 1)
    by_memory = 1 + available_memory().bytes // per_job
    return max(1, min(cores or 1, runs, by_memory))


def run_jobs(wanted, *, loaded, opts, seq_len, origin):
    """``run_steps`` for a plan's jobs: ``--jobs`` processes, or as many as
    ``auto_jobs`` allows for the model; returns each job's result and the number of
    processes that ran them."""
    jobs = opts.jobs
    if jobs is None:
        modules = sum(1 for _ in loaded.module.modules()) if loaded.module else 0
        jobs = auto_jobs(len(wanted), modules)
    found = run_steps(
        wanted,
        lambda job: job.run(loaded, opts, seq_len),
        jobs=jobs,
        origin=origin,
        measure=_job,
        worker_args=(opts, seq_len),
    )
    return found, max(1, min(jobs, len(wanted))) if origin is not None else 1


def _job(loaded, opts, seq_len, job):
    return job.run(loaded, opts, seq_len)


def run_steps(
    cells: Sequence,
    local: Callable[[Any], Any],
    *,
    jobs: int,
    origin: Origin | None,
    measure: Callable[..., Any],
    worker_args: tuple[Any, ...],
) -> dict[Any, Any]:
    """The result of every job (a ``Cell`` or a job of one): ``local(job)`` here, and
    in workers ``measure(loaded, *worker_args, job)`` (a module-level function: it is
    pickled by name) on the source they load. Without an ``origin`` (a module built in
    this process only) every job runs here."""
    order = sorted(dict.fromkeys(cells), key=_cost, reverse=True)
    jobs = max(1, min(jobs, len(order)))
    if jobs == 1 or origin is None:
        return {cell: local(cell) for cell in order}
    queue = deque(order)
    results: dict[Any, Any] = {}
    failures: list[BaseException] = []
    with _pool(jobs - 1, (origin, measure, *worker_args)) as pool:

        def feed() -> None:  # one thread per worker: it waits, the worker computes
            while not failures:
                try:
                    cell = queue.popleft()
                except IndexError:
                    return
                try:
                    results[cell] = pool.apply(_run, (cell,))
                except BaseException as exc:  # noqa: BLE001 - re-raised below, in order
                    failures.append(exc)

        threads = [threading.Thread(target=feed, daemon=True) for _ in range(jobs - 1)]
        for t in threads:
            t.start()
        while not failures:
            try:
                cell = queue.pop()
            except IndexError:
                break
            results[cell] = local(cell)
        for t in threads:
            t.join()
    if failures:
        raise failures[0]
    return results


def _pool(processes: int, initargs: tuple):
    """A spawn pool whose workers never see SIGINT. A terminal's Ctrl-C reaches the
    whole process group; it is this process's to handle (the pool is terminated on
    the way out), not a half-started worker's to print a traceback for. SIGINT is
    ignored here while the workers are forked: an ignored signal stays ignored
    through exec, and Python then leaves it so, from the worker's first instruction.
    (A blocked mask would not do: the spawn's fork-exec clears it.) A Ctrl-C in
    those few milliseconds is lost; the next one counts."""
    ctx = multiprocessing.get_context("spawn")
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        return ctx.Pool(processes, initializer=_init, initargs=initargs)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, before)


def _cost(key) -> tuple[bool, int]:
    """Checkpointed runs recompute the forward; more micro-batch is more tokens (of a
    ``Cell``, or of a job's ``cell``)."""
    cell = getattr(key, "cell", key)
    return cell.checkpointing != "none", cell.micro_batch


_WORKER: dict[str, Any] = {}


def _init(origin: Origin, measure: Callable, *args: Any) -> None:
    from ..sources import load_source

    loaded = load_source(origin.source, model=origin.model, trust_pickle=origin.trust_pickle)
    _WORKER["run"] = (measure, loaded, args)


def _run(cell) -> Any:
    measure, loaded, args = _WORKER["run"]
    return measure(loaded, *args, cell)
