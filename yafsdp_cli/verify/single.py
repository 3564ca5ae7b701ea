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

Both optimizers keep their state on disk between parameters (``offload``): held at
once are one model's parameters and gradients, plus one step's activations, or one
parameter's optimizer state and temporaries while it steps.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    deterministic_kernels,
    held_bytes,
    micro_seed,
    named_grads,
    named_params,
    rank_memory,
    resolve_tolerances,
    unused_kept,
    with_idioms,
)
from .offload import OffloadedOptimizer
from .store import ReferenceStore

RNG_NOTE = (
    "the converted model drew a different amount of random numbers than the original "
    "({where}): some op of one draws where the other's does not"
)
START = -1  # the store's "step" holding the starting values


def run_single(prep: Prepared, opts: VerifyOptions) -> VerifyReport:
    with deterministic_kernels(opts):
        return _run_single(prep, opts)


def _run_single(prep: Prepared, opts: VerifyOptions) -> VerifyReport:
    module = prep.original
    run, notes = with_idioms(module, prep.layout, opts)
    with ReferenceStore() as store:
        store.save_step(START, _starting_values(module))
        drawn = run_original(module, run, opts, store)
        release_freed()  # the original's optimizer state and gradients
        _put_back(module, store)
        if opts.compile:
            torch._dynamo.reset()  # the converted model compiles afresh, as a second model would
        flat = convert_module(module, prep.layout)
        release_freed()  # the parameters' old storages, now copied into the flat buffers
        run = compiled(module) if opts.compile else module
        rec = Recorder(resolve_tolerances(opts.device, opts.atol, opts.rtol))
        memory, drift = run_converted(flat, run, opts, store, rec, drawn, prep.layout)
    if drift:
        notes.append(RNG_NOTE.format(where=", ".join(drift[:3])))
    return build_report(prep, opts, rec, (memory,), backend="", extra_notes=notes)


def _starting_values(module) -> dict[str, Mapping]:
    return {
        "parameter": {n: p.detach() for n, p in module.named_parameters()},
        "buffer": dict(module.named_buffers()),
    }


def run_original(module, run, opts: VerifyOptions, store: ReferenceStore) -> list[bytes]:
    """Every step of the original, kept on disk; the generators' state after each
    micro-batch."""
    opt = OffloadedOptimizer(opts.optimizer, module.parameters(), store.folder, "original")
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


def _put_back(module, store: ReferenceStore) -> None:
    """The module's parameters and buffers back to their starting values, in place."""
    with store.open_step(START) as handle, torch.no_grad():
        for kind, items in (("parameter", module.named_parameters()), ("buffer", None)):
            items = dict(items) if items is not None else dict(module.named_buffers())
            stored = store.view(handle, START, kind)
            for name, t in items.items():
                t.copy_(stored[name])


def run_converted(flat: FlatModel, run, opts, store: ReferenceStore, rec: Recorder, drawn, layout):
    """The converted model's steps, each tensor compared with the original's on disk."""
    module = flat.module
    opt = OffloadedOptimizer(opts.optimizer, flat.parameters(), store.folder, "converted")
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
    return "cuda:0" if opts.device == "cuda" else "cpu"


def _single_memory(
    flat: FlatModel, opt: OffloadedOptimizer, layout: Layout, opts: VerifyOptions
) -> RankMemory:
    params = flat.parameters()
    r = allocation_rounding(opts.device)
    grads = [p.grad for p in params]
    held = held_bytes((params, grads, [], list(flat.module.buffers())), r)
    held = replace(held, optimizer=opt.held_bytes(r))  # on disk, but a training run holds it
    return rank_memory(0, held, layout, opts.optimizer, r, unused_kept(flat.kept_parameters()))
