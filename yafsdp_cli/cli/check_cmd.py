"""`yafsdp check`: the CI memory-regression gate against a baseline JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .command_kit import (
    EXIT_CHECK_FAILED,
    ExcludeOpt,
    FilterOpt,
    JsonOpt,
    ModelOpt,
    TrustPickleOpt,
    UnitOpt,
    errors_to_exit,
    stderr,
    stdout,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .root import app

AS_RECORDED = "Default: as the baseline recorded it."


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
            min=0,
            help="Allowed growth of any figure, in percent. Default: 1 for the memory "
            "model, 0.1 for the fake step (its figures are exact).",
            show_default=False,
        ),
    ] = None,
    step_tolerance: Annotated[
        float | None,
        typer.Option(
            "--step-tolerance",
            min=0,
            help="Allowed growth of the fake step's figures, in percent. Default: "
            "--tolerance if given, else 0.1.",
            show_default=False,
        ),
    ] = None,
    no_step: Annotated[
        bool, typer.Option("--no-step", help="Gate the memory model only; no fake step.")
    ] = False,
    batch: Annotated[
        int | None, typer.Option("--batch", min=1, help=f"Fake step batch size. {AS_RECORDED}")
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", min=1, help=f"Fake step tokens per sample. {AS_RECORDED}"),
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(
            "--checkpointing",
            help=f"Fake step activation checkpointing: none | reentrant | non-reentrant. "
            f"{AS_RECORDED}",
        ),
    ] = None,
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: Annotated[
        int | None, typer.Option("--world-size", "-n", min=1, help=f"Ranks. {AS_RECORDED}")
    ] = None,
    align: Annotated[str | None, typer.Option("--align", help=f"Alignment. {AS_RECORDED}")] = None,
    param_dtype: Annotated[
        str | None, typer.Option("--param-dtype", metavar="DTYPE", help=AS_RECORDED)
    ] = None,
    grad_dtype: Annotated[
        str | None, typer.Option("--grad-dtype", metavar="DTYPE", help=AS_RECORDED)
    ] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", help=AS_RECORDED)] = None,
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
    without --update in CI.
    """
    overrides = {
        "filters": tuple(filters) if filters else None,
        "excludes": tuple(excludes) if excludes else None,
        "units": tuple(units) if units else None,
        "world_size": world_size,
        "align": align,
        "param_dtype": param_dtype,
        "grad_dtype": grad_dtype,
        "optimizer": optimizer,
    }
    with errors_to_exit():
        check_html_path(html, source, baseline)
        from ..engine.idioms import check_checkpointing
        from ..gate.baseline import plan_baseline
        from ..gate.run_check import CheckRequest, run_check

        plan_doc = plan_baseline(baseline)
        if plan_doc is not None:
            from ..errors import YafsdpError
            from .plan_cmd import check_plan

            if update:
                raise YafsdpError(
                    "a plan baseline is written by `yafsdp plan --json`, not --update"
                )
            check_plan(plan_doc, trust_pickle)
            return

        if checkpointing is not None:
            check_checkpointing(checkpointing)
        outcome = run_check(
            CheckRequest(
                baseline=baseline,
                source=source,
                model=model,
                update=update,
                tolerance=tolerance,
                step_tolerance=step_tolerance,
                overrides=overrides,
                batch=batch,
                seq_len=seq_len,
                checkpointing=checkpointing,
                step=not no_step,
                trust_pickle=trust_pickle,
            )
        )
        result = outcome.report
        _write_page(html, result, outcome.inspect)  # the CI artifact, written pass or fail
        if result is None:
            stderr.print(_written(baseline, outcome.current), markup=False, highlight=False)
            return
        _render(result, json_out, markdown)
    if not result.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _written(path: Path, current) -> str:
    from ..report.formatting import human_bytes

    text = f"wrote baseline {path} (flat {human_bytes(current.memory.flat_bytes)} per rank"
    if current.step is not None:
        text += f"; fake step peak {human_bytes(current.step.peak_total)}, {current.step.batch}"
    text += ")"
    return "; ".join([text, *(f"skipped: {s}" for s in current.skipped)])


def _write_page(html: Path | None, result, report) -> None:
    if html is not None:
        from ..report.html import check_page

        write_html(html, check_page(result, report))


def _render(result, json_out: bool, markdown: bool) -> None:
    from ..report import gate_view as view

    if json_out:
        sys.stdout.write(view.to_json(result) + "\n")
    elif markdown:
        sys.stdout.write(view.to_markdown(result))
    else:
        for renderable in view.to_rich(result):
            stdout.print(renderable)
