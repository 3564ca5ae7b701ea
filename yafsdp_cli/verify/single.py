"""Single-process verify, one model alive at a time.

1. The module's starting parameters and buffers go to disk (``store``).
2. The original trains for every step; after each step its outputs, every gradient
   by name and every parameter and buffer after the optimizer step go to disk, with
   the state of the random generators after each micro-batch (for the RNG note).
3. Its optimizer and gradients are dropped and the same module object is put back to
   its starting values from disk, then converted in place (``convert_module``), so no
   second copy of the model ever exists.
4. The converted model runs the same micro-batches; each tensor is compared with the
   original's, read back from disk one at a time.
5. Only on a mismatch: the converted model is dropped, the original is built afresh
   and given its starting values, it runs every step again,
   and its second run is compared bit for bit with its first. A drift there means the
   reference itself is not reproducible on this machine, and the report says so
   instead of blaming the conversion.

Both models run pinned (``numerics``): one thread count, no dynamic thread
adjustment, torch's deterministic algorithms, set again before each model's run.

Both optimizers keep their state on disk between parameters (``offload``): held at
once are one model's parameters and gradients, plus one step's activations, or one
parameter's optimizer state and temporaries while it steps.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engine.flat import FlatModel, convert_module
from ..engine.idioms import compiled
from ..engine.layout import Layout
from ..engine.train_step import forward_backward, rng_fingerprint
from .budget import release_freed
from .harness import (
    Prepared,
    RankMemory,
    Recorder,
    VerifyOptions,
    VerifyReport,
    allocation_rounding,
    batch_for,
    build_report,
    held_bytes,
    micro_seed,
    named_grads,
    named_params,
    rank_memory,
    resolve_tolerances,
    unused_kept,
    with_idioms,
)
from .numerics import apply, pinned
from .offload import OffloadedOptimizer
from .recheck import START, first_drift, put_back, starting_values, with_recheck
from .store import ReferenceStore

RNG_NOTE = (
    "the converted model drew a different amount of random numbers than the original "
    "({where}): some op of one draws where the other's does not"
)


def run_single(prep: Prepared, opts: VerifyOptions, rebuild=None) -> VerifyReport:
    """``rebuild()`` makes the original module afresh for the re-check of a mismatch
    (the converted one may be what is broken, so it is not turned back); without it
    no re-check is made."""
    with pinned() as pins:
        report = _run_single(prep, opts, pins.threads, rebuild)
    return replace(report, pinned=pins.describe())


def _run_single(prep: Prepared, opts: VerifyOptions, threads: int, rebuild) -> VerifyReport:
    module = prep.original
    run, notes = with_idioms(module, prep.layout, opts)
    with ReferenceStore() as store:
        store.save_step(START, starting_values(module))
        drawn = run_original(module, run, opts, store)
        release_freed()  # the original's optimizer state and gradients
        put_back(module, store)
        if opts.compile:
            torch._dynamo.reset()  # the converted model compiles afresh, as a second model would
        flat = convert_module(module, prep.layout)
        release_freed()  # the parameters' old storages, now copied into the flat buffers
        run = compiled(module) if opts.compile else module
        rec = Recorder(resolve_tolerances(opts.step.device, opts.atol, opts.rtol))
        apply(threads)
        memory, drift = run_converted(flat, run, opts, store, rec, drawn, prep.layout)
        rerun = None
        if rec.failures and rebuild is not None:
            del flat, run, module
            prep.original = None  # the converted module: gone before the rebuild
            release_freed()
            apply(threads)
            rerun = recheck_original(rebuild(), prep.layout, opts, store)
    if drift:
        notes.append(RNG_NOTE.format(where=", ".join(drift[:3])))
    report = build_report(prep, opts, rec, (memory,), backend="", extra_notes=notes)
    return with_recheck(report, rerun)


def recheck_original(module, layout: Layout, opts: VerifyOptions, store: ReferenceStore):
    """The original's every step again, from its starting values, compared bit for bit
    with its first run on disk: the first tensor that drifted, or None."""
    put_back(module, store)
    if opts.compile:
        torch._dynamo.reset()
    run, _ = with_idioms(module, layout, opts)
    with ReferenceStore() as again:
        run_original(module, run, opts, again)
        return first_drift(store, again, opts.steps)


def run_original(module, run, opts: VerifyOptions, store: ReferenceStore) -> list[bytes]:
    """Every step of the original, kept on disk; the generators' state after each
    micro-batch."""
    opt = OffloadedOptimizer(opts.step.optimizer, module.parameters(), store.folder, "original")
    drawn = []
    for step in range(opts.steps):
        outputs = {}
        for m in range(opts.micro_batches):
            seed = micro_seed(opts, step, m)
            outputs[f"output (micro-batch {m})"] = forward_backward(
                run, batch_for(module, opts, seed), seed
            )
            drawn.append(rng_fingerprint())
        grads = named_grads(module)
        opt.step(last=step == opts.steps - 1)
        parts = {"output": outputs, "gradient": grads, "parameter": named_params(module)}
        parts["buffer"] = dict(module.named_buffers())
        store.save_step(step, parts)
        # the next step's backward must not find this step's gradients still held here
        del grads, parts, outputs
        module.zero_grad(set_to_none=True)
    return drawn


def run_converted(flat: FlatModel, run, opts, store: ReferenceStore, rec: Recorder, drawn, layout):
    """The converted model's steps, each tensor compared with the original's on disk."""
    module = flat.module
    opt = OffloadedOptimizer(opts.step.optimizer, flat.parameters(), store.folder, "converted")
    memory, drift = None, []
    for step in range(opts.steps):
        with store.open_step(step, _device(opts)) as handle:
            want = {k: store.view(handle, step, k) for k in ("output", "gradient", "parameter")}
            for m in range(opts.micro_batches):
                seed = micro_seed(opts, step, m)
                got = forward_backward(run, batch_for(module, opts, seed), seed)
                if rng_fingerprint() != drawn[step * opts.micro_batches + m]:
                    drift.append(f"step {step} micro-batch {m}")
                name = f"output (micro-batch {m})"
                rec.compare("output", name, step, got, want["output"][name])
            rec.compare_all("gradient", step, flat.named_grads(), want["gradient"])
            opt.step(last=step == opts.steps - 1)
            if step == opts.steps - 1:
                memory = _single_memory(flat, opt, layout, opts)
            rec.compare_all("parameter", step, flat.named_params(), want["parameter"])
            buffers = store.view(handle, step, "buffer")
            rec.compare_all("buffer", step, dict(module.named_buffers()), buffers)
        flat.zero_grad()
    flat.check_padding()
    return memory, drift


def _device(opts: VerifyOptions) -> str:
    return "cuda:0" if opts.step.device == "cuda" else "cpu"


def _single_memory(
    flat: FlatModel, opt: OffloadedOptimizer, layout: Layout, opts: VerifyOptions
) -> RankMemory:
    params = flat.parameters()
    r = allocation_rounding(opts.step.device)
    grads = [p.grad for p in params]
    held = held_bytes((params, grads, [], list(flat.module.buffers())), r)
    held = replace(held, optimizer=opt.held_bytes(r))  # on disk, but a training run holds it
    return rank_memory(0, held, layout, opts.step.optimizer, r, unused_kept(flat.kept_parameters()))
