"""The simultaneous verify (original and converted twin side by side), the reference
for the test that the sequential run gives the same report."""

from __future__ import annotations

import copy

from yafsdp_cli.engine.flat import FlatModel, convert_module
from yafsdp_cli.engine.layout import Layout
from yafsdp_cli.engine.train_step import (
    forward_backward,
    make_optimizer,
    optimizer_tensors,
    rng_fingerprint,
)
from yafsdp_cli.verify.harness import (
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

RNG_NOTE = (
    "the converted model drew a different amount of random numbers than the original "
    "({where}): some op of one draws where the other's does not"
)


def run_single(prep: Prepared, opts: VerifyOptions) -> VerifyReport:
    original = prep.original
    twin = copy.deepcopy(original)
    run_original, notes = with_idioms(original, prep.layout, opts)
    run_twin, _ = with_idioms(twin, prep.layout, opts)
    flat = convert_module(twin, prep.layout)
    rec = Recorder(resolve_tolerances(opts.step.device, opts.atol, opts.rtol))
    ref_opt = make_optimizer(opts.step.optimizer, original.parameters())
    opt = make_optimizer(opts.step.optimizer, flat.parameters())
    memory, drift = None, []
    for step in range(opts.steps):
        for m in range(opts.micro_batches):
            seed = micro_seed(opts, step, m)
            batch = batch_for(original, opts, seed)
            want = forward_backward(run_original, batch, seed)
            drawn = rng_fingerprint()
            got = forward_backward(run_twin, batch, seed)
            if rng_fingerprint() != drawn:
                drift.append(f"step {step} micro-batch {m}")
            rec.compare("output", f"output (micro-batch {m})", step, got, want)
        rec.compare_all("gradient", step, flat.named_grads(), named_grads(original))
        for o in (ref_opt, opt):
            if o is not None:
                o.step()
        if step == opts.steps - 1:
            memory = _single_memory(flat, opt, prep.layout, opts)
        rec.compare_all("parameter", step, flat.named_params(), named_params(original))
        rec.compare_all("buffer", step, dict(twin.named_buffers()), dict(original.named_buffers()))
        original.zero_grad(set_to_none=True)
        flat.zero_grad()
    flat.check_padding()
    if drift:
        notes.append(RNG_NOTE.format(where=", ".join(drift[:3])))
    return build_report(prep, opts, rec, (memory,), backend="", extra_notes=notes)


def _single_memory(flat: FlatModel, opt, layout: Layout, opts: VerifyOptions) -> RankMemory:
    params = flat.parameters()
    r = allocation_rounding(opts.step.device)
    grads = [p.grad for p in params]
    groups = (params, grads, optimizer_tensors(opt), list(flat.module.buffers()))
    held = held_bytes(groups, r)
    return rank_memory(0, held, layout, opts.step.optimizer, r, unused_kept(flat.kept_parameters()))
