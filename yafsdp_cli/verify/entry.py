"""Entry points of verify: one process, or N ranks launched here or by torchrun."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engine.plan import plan
from ..errors import YafsdpError
from ..options import LayoutOptions
from .budget import peak_rss
from .dist import launched_by_torchrun, run_world, torchrun_rank, verify_this_rank
from .harness import VerifyOptions, VerifyReport, prepare
from .run_plan import RunPlan, plan_run
from .single import run_single


def verify_model(loaded, opts: VerifyOptions | None = None, on_plan=None) -> VerifyReport:
    """Verify a loaded model (``sources.load_source``) in this process.

    First its peak is estimated (``run_plan.plan_run``): a run that cannot fit raises
    ``MemoryBudgetError`` before anything is allocated, or, without ``--blocks``,
    runs on the most blocks that fit. ``on_plan(RunPlan)`` is called once both models
    are built and the run goes ahead, so nothing is estimated aloud before an error.

    With ``opts.layout.world_size > 1`` this process must be one rank of a running
    ``torch.distributed`` job (torchrun); ``verify_source`` launches the ranks itself.
    """
    opts = opts or VerifyOptions()
    if opts.layout.world_size > 1:
        return verify_this_rank(loaded, opts)
    run_plan = plan_run(loaded, opts)
    opts = run_plan.opts
    prepared = prepare(loaded, opts)  # builds the models: a source without one fails here
    if on_plan is not None:  # so the estimate is printed only for a run that goes ahead
        on_plan(run_plan)
    report = run_single(prepared, opts, rebuild=lambda: prepare(loaded, opts).original)
    return finish(report, run_plan, peak_rss())


def finish(report: VerifyReport, run_plan: RunPlan, peak: int) -> VerifyReport:
    """The report with the estimate, the blocks and the measured peak beside it."""
    source = report.source
    if run_plan.blocks is not None and not run_plan.blocks.whole:
        kept = run_plan.blocks
        source += f" (blocks {', '.join(map(str, kept.kept))} of {kept.total})"
    return replace(
        report, source=source, budget=run_plan.budget, blocks=run_plan.blocks, peak_rss=peak
    )


def verify_source(
    source: str | None,
    *,
    model: str | None = None,
    trust_pickle: bool = False,
    opts=None,
    on_plan=None,
) -> VerifyReport:
    """Load ``source`` (and/or ``--model``) and verify it, on ``opts.layout.world_size``
    processes when that is more than one (launched here, or this process's rank
    when started by torchrun)."""
    from ..sources import load_source

    opts = opts or VerifyOptions()
    if launched_by_torchrun():
        return torchrun_rank(source, model, trust_pickle, opts)
    loaded = load_source(source, model=model, trust_pickle=trust_pickle)
    if opts.layout.world_size == 1:
        return verify_model(loaded, opts, on_plan)
    check_before_launch(loaded, opts)
    run_plan = plan_run(loaded, opts)
    if on_plan is not None:
        on_plan(run_plan)
    report = run_world([(source, model, trust_pickle, run_plan.opts)])[0]
    return finish(report, run_plan, peak_rss(children=True))


def check_before_launch(loaded, opts: VerifyOptions) -> None:
    """Fail here, with one clear error, on what every rank would fail on."""
    if opts.step.device == "cuda" and not torch.cuda.is_available():
        raise YafsdpError("--device cuda: no CUDA device is available; use --device cpu")
    if loaded.module is None and loaded.factory is None:
        loaded.build_module()  # raises the "needs its architecture" error
    layout = plan(loaded.spec, opts.layout)
    if not layout.buffers:
        raise YafsdpError("the filters select no parameter to convert; nothing to verify")


def model_check(loaded, layout: LayoutOptions) -> tuple[bool | None, str]:
    """``yafsdp verify``'s single-process check of the original against the model
    converted with the same layout piece as ``convert``'s: (passed or None, what
    happened).

    The byte round trip shows the file holds the source's tensors; this shows the
    converted model computes the same outputs, gradients and optimizer step."""
    if not loaded.spec.has_architecture:
        return None, (
            "not run: no architecture (give --model package.module:factory or a Hugging "
            "Face folder)"
        )
    opts = VerifyOptions(layout=layout)
    try:
        report = verify_model(loaded, opts)
    except YafsdpError as exc:
        return None, f"not run: {exc}"
    if report.ok:
        return True, f"passed ({report.compared} comparisons over {report.steps} steps)"
    if not report.reproducible:
        d = report.drift
        return None, (
            f"no verdict: the original did not reproduce its own numbers when run again "
            f"({d.kind} {d.name} at step {d.step}, max abs {d.max_abs:.3g})"
        )
    return False, f"FAILED: {report.failures} of {report.compared} comparisons out of tolerance"
