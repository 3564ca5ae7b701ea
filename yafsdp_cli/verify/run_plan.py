"""Before verify allocates anything: its peak, what is available, and which blocks.

``plan_run`` estimates the run's peak (``budget``) from the meta-device architecture
and compares it with the memory this process may use. It fits: run as asked. It does
not fit and ``--blocks`` was not given, but the model can be built with fewer blocks
(``blocks``): the most blocks that fit, spread evenly with the first and the last,
and the report says so. Otherwise ``MemoryBudgetError``: what it needs, what is
available, and the options that would fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..errors import YafsdpError
from .blocks import BlockChoice, blocked_source, build_meta, original_name, parse_blocks, spread
from .budget import (
    Available,
    Budget,
    available_memory,
    estimate_activations,
    estimate_peak,
    process_rss,
)
from .harness import VerifyOptions, batch_for, with_world_size


@dataclass(frozen=True, slots=True)
class RunPlan:
    budget: Budget
    blocks: BlockChoice | None  # None: the model as it is
    opts: VerifyOptions  # with the chosen blocks as indices


class MemoryBudgetError(YafsdpError):
    """The run cannot fit; ``suggestions`` are (option, its estimated peak) that fit."""

    def __init__(self, budget: Budget, suggestions: tuple[tuple[str, int], ...]):
        self.budget, self.suggestions = budget, suggestions
        est, avail = budget.estimate, budget.available
        tail = "; ".join(f"{o} (needs {b:,} B)" for o, b in suggestions) or "none of its options"
        super().__init__(
            f"verify needs about {est.total:,} B but {avail.bytes:,} B are available "
            f"({avail.source}); what would fit: {tail}, or a machine with more free memory"
        )


def plan_run(loaded, opts: VerifyOptions, available: Available | None = None) -> RunPlan:
    """The run's budget and blocks, or ``MemoryBudgetError`` (see the module docstring)."""
    available = available or available_memory()
    choice = None
    if opts.blocks:
        blocked = blocked_source(loaded)
        kept = parse_blocks(opts.blocks, blocked.total)
        choice = BlockChoice(kept, blocked.total, blocked.stack, f"--blocks {opts.blocks}")
    budget = budget_for(loaded, opts, available, choice)
    if budget.fits:
        return RunPlan(budget, choice, with_blocks(opts, choice))
    if not opts.blocks:
        auto = _most_blocks_that_fit(loaded, opts, available, budget)
        if auto is not None:
            return auto
    raise MemoryBudgetError(budget, _suggestions(loaded, opts, available, choice))


def budget_for(loaded, opts: VerifyOptions, available: Available, choice=None) -> Budget:
    meta, spec = _meta_and_spec(loaded, choice)
    layout = plan(spec, replace(opts.layout, world_size=1))
    activations = -1
    if meta is not None:
        try:
            activations = estimate_activations(meta, batch_for(meta, opts, opts.step.seed))
        except YafsdpError:
            activations = -1
    ranks, models = (opts.layout.world_size, 2) if opts.layout.world_size > 1 else (1, 1)
    estimate = estimate_peak(
        layout, opts.step.optimizer, activations, ranks=ranks, models=models, offloaded=ranks == 1
    )
    return Budget(estimate, available, process_rss())


def _meta_and_spec(loaded, choice: BlockChoice | None):
    """The meta-device module to estimate activations on (None for a real module)
    and the spec to plan with, in the dtypes the weights have."""
    if choice is None:
        module = loaded.module
        meta = module if module is not None and _on_meta(module) else None
        return meta, loaded.spec
    meta = build_meta(blocked_source(loaded), choice.kept)
    stored = loaded.spec.by_name()
    spec = spec_from_module(meta, source=loaded.spec.source)
    tensors = []
    for t in spec.tensors:
        src = stored.get(original_name(t.name, choice.stack, choice.kept))
        tensors.append(replace(t, dtype=src.dtype) if src is not None else t)
    return meta, replace(spec, tensors=tuple(tensors))


def _on_meta(module) -> bool:
    return any(p.device.type == "meta" for p in module.parameters())


def _most_blocks_that_fit(loaded, opts, available, whole: Budget) -> RunPlan | None:
    try:
        blocked = blocked_source(loaded)
    except YafsdpError:
        return None
    lo, hi, best = 1, blocked.total - 1, None
    while lo <= hi:  # the estimate grows with the count of blocks
        mid = (lo + hi) // 2
        choice = BlockChoice(spread(mid, blocked.total), blocked.total, blocked.stack, "")
        budget = budget_for(loaded, opts, available, choice)
        if budget.fits:
            best, lo = (choice, budget), mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None
    choice, budget = best
    why = (
        f"the whole model needs about {whole.estimate.total:,} B, {available.bytes:,} B are "
        f"available ({available.source}): the most blocks that fit"
    )
    choice = dataclasses.replace(choice, why=why)
    return RunPlan(budget, choice, with_blocks(opts, choice))


def _suggestions(loaded, opts, available, choice) -> tuple[tuple[str, int], ...]:
    """Options that would fit, each with its estimate."""
    out = []
    for optimizer in ("sgd", "none"):
        if opts.step.optimizer not in (optimizer, "none"):
            lighter = replace(opts, step=replace(opts.step, optimizer=optimizer))
            b = budget_for(loaded, lighter, available, choice)
            if b.fits:
                out.append((f"--optimizer {optimizer}", b.estimate.total))
    if opts.layout.world_size > 1:
        b = budget_for(loaded, with_world_size(opts, 1), available, choice)
        if b.fits:
            out.append(("one process (no --world-size)", b.estimate.total))
    try:
        blocked = blocked_source(loaded)
    except YafsdpError:
        return tuple(out)
    for count in (2, 1):
        if count < blocked.total and (choice is None or count < len(choice.kept)):
            small = BlockChoice(spread(count, blocked.total), blocked.total, blocked.stack, "")
            b = budget_for(loaded, opts, available, small)
            if b.fits:
                out.append((f"--blocks {count}", b.estimate.total))
                break
    return tuple(out)


def with_blocks(opts: VerifyOptions, choice: BlockChoice | None) -> VerifyOptions:
    """``opts`` with the chosen blocks as explicit indices (what every rank builds)."""
    if choice is None:
        return opts
    spec = ",".join(map(str, choice.kept)) + ("," if len(choice.kept) == 1 else "")
    return replace(opts, blocks=spec)
