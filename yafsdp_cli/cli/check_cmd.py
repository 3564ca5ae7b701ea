"""`yafsdp check`: the CI memory-regression gate against a baseline JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..numbers import MAX_PERCENT
from .command_kit import EXIT_CHECK_FAILED, errors_to_exit, stderr, stdout
from .flags import (
    AlignOpt,
    BatchOpt,
    CheckpointingOpt,
    ExcludeOpt,
    FilterOpt,
    FreezeOpt,
    GradAccumOpt,
    GradDtypeOpt,
    JsonOpt,
    LoraOpt,
    LossOpt,
    ModelOpt,
    OptimizerOpt,
    ParamDtypeOpt,
    QuantizeOpt,
    SeqLenOpt,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    layout_given,
    number,
    render,
    step_given,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .root import app

PERCENT = number(0, MAX_PERCENT, whole=False)  # a growth in percent, finite and at least 0


@app.command("check")
def check_command(
    source: Annotated[
        str | None,
        typer.Argument(help="The model to check (default: the source the baseline names)."),
    ] = None,
    baseline: Annotated[
        Path,
        typer.Option("--baseline", "-b", help="The baseline JSON (`check --update` writes it)."),
    ] = ...,
    update: Annotated[
        bool, typer.Option("--update", help="Write the current figures as the new baseline.")
    ] = False,
    tolerance: Annotated[
        float | None,
        typer.Option(
            "--tolerance",
            parser=PERCENT,
            metavar="FLOAT",
            help="Allowed growth of any figure, in percent. Default: 1 for the memory "
            "model, 0.1 for the fake step (its figures are exact).",
            show_default=False,
        ),
    ] = None,
    step_tolerance: Annotated[
        float | None,
        typer.Option(
            "--step-tolerance",
            parser=PERCENT,
            metavar="FLOAT",
            help="Allowed growth of the fake step's figures, in percent. Default: "
            "--tolerance if given, else 0.1.",
            show_default=False,
        ),
    ] = None,
    min_bytes: Annotated[
        str | None,
        typer.Option(
            "--min-bytes",
            metavar="SIZE",
            help="A figure in bytes regresses only when it also grew by more than this, "
            "e.g. 1MiB (the default) or 0.",
            show_default=False,
        ),
    ] = None,
    no_step: Annotated[
        bool, typer.Option("--no-step", help="Gate the memory model only; no fake step.")
    ] = False,
    batch: BatchOpt = None,
    grad_accum: GradAccumOpt = None,
    seq_len: SeqLenOpt = None,
    checkpointing: CheckpointingOpt = None,
    loss: LossOpt = None,
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = None,
    align: AlignOpt = None,
    param_dtype: ParamDtypeOpt = None,
    grad_dtype: GradDtypeOpt = None,
    freeze: FreezeOpt = None,
    lora: LoraOpt = None,
    quantize: QuantizeOpt = None,
    optimizer: OptimizerOpt = None,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    json_out: JsonOpt = False,
    markdown: Annotated[
        bool,
        typer.Option("--markdown", help="Print markdown (for $GITHUB_STEP_SUMMARY or a comment)."),
    ] = False,
    html: HtmlOpt = None,
) -> None:
    """CI memory-regression gate: exit 1 if a figure grew past its tolerance.

    Figures: the memory model per rank and, where the source has an architecture, a
    fake training step (peak by category and phase, saved activations by module).
    Create the baseline once with --update (commit it), then run the same command
    without --update in CI. Options the baseline records (layout, dtypes, optimizer,
    the step's batch, micro-batches, length and checkpointing) default to what it
    recorded.
    """
    with errors_to_exit():
        check_html_path(html, source, baseline)
        from ..gate.baseline import plan_baseline
        from ..gate.run_check import CheckRequest, run_check
        from ..options.sizes import parse_size
        from ..report import gate_view as view

        plan_doc = plan_baseline(baseline)
        if plan_doc is not None:
            _recheck_plan(plan_doc, update, trust_pickle, f"baseline {baseline}")
            return
        outcome = run_check(
            CheckRequest(
                baseline=baseline,
                source=source,
                model=model,
                update=update,
                tolerance=tolerance,
                step_tolerance=step_tolerance,
                min_bytes=None if min_bytes is None else parse_size(min_bytes, "--min-bytes"),
                # the options a baseline records: given, they replace the recorded ones
                layout_given=layout_given(
                    filters=filters,
                    excludes=excludes,
                    units=units,
                    world_size=world_size,
                    align=align,
                ),
                step_given=step_given(
                    param_dtype=param_dtype,
                    grad_dtype=grad_dtype,
                    freeze=freeze,
                    lora=lora,
                    quantize=quantize,
                    optimizer=optimizer,
                    batch=batch,
                    grad_accum=grad_accum,
                    seq_len=seq_len,
                    checkpointing=checkpointing,
                    loss=loss,
                ),
                step=not no_step,
                trust_pickle=trust_pickle,
            )
        )
        result = outcome.report
        _write_page(html, result, outcome.inspect)  # the CI artifact, written pass or fail
        if result is None:
            stderr.print(_written(baseline, outcome.current), markup=False, highlight=False)
            return
        render(view, result, "json" if json_out else "markdown" if markdown else "table")
    if not result.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _written(path: Path, current) -> str:
    from ..report.formatting import human_bytes

    text = f"wrote baseline {path} (flat {human_bytes(current.memory.flat_bytes)} per rank"
    if current.step is not None:
        text += f"; fake step peak {human_bytes(current.step.peak_total)}, {current.step.batch}"
        accum = current.step.inputs.grad_accum
        text += f", {accum} micro-batches per optimizer step" if accum > 1 else ""
    text += ")"
    return "; ".join([text, *(f"skipped: {s}" for s in current.skipped)])


def _write_page(html: Path | None, result, report) -> None:
    if html is not None:
        from ..report.html_pages import check_page

        write_html(html, check_page(result, report))


def _recheck_plan(doc, update: bool, trust_pickle: bool, where: str) -> None:
    """A saved plan as the baseline: plan again; exit 1 if a configuration that
    fitted no longer does."""
    from ..errors import YafsdpError
    from ..gate.plan_recheck import recheck_plan

    if update:
        raise YafsdpError("a plan baseline is written by `yafsdp plan --json`, not --update")
    outcome = recheck_plan(doc, trust_pickle, where)
    for line in outcome.lost:
        stdout.print(f"regression: {line}", markup=False, highlight=False)
    if not outcome.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)
    stdout.print(f"ok: every configuration that fitted still fits ({outcome.checked} checked)")
