"""`yafsdp check`: the CI memory-regression gate against a baseline JSON."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from .app import app
from .common import (
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

AS_RECORDED = "Default: as the baseline recorded it."


@app.command("check")
def check_command(
    source: Annotated[
        str | None,
        typer.Argument(help="The model to check (default: the source the baseline names)."),
    ] = None,
    baseline: Annotated[
        Path,
        typer.Option("--baseline", "-b", help="A saved `yafsdp inspect --json` document."),
    ] = ...,
    update: Annotated[
        bool, typer.Option("--update", help="Write the current figures as the new baseline.")
    ] = False,
    tolerance: Annotated[
        float,
        typer.Option("--tolerance", help="Allowed growth of any figure, in percent.", min=0),
    ] = 1.0,
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
    markdown: Annotated[bool, typer.Option("--markdown", help="Print a markdown table.")] = False,
    html: HtmlOpt = None,
) -> None:
    """CI memory-regression gate: exit 1 if a per-rank figure grew past --tolerance.

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
        from ..errors import YafsdpError
        from ..gate.check import baseline_inputs, compare, load_baseline
        from ..inspect.build import inspect_model
        from ..report import inspect as inspect_view
        from ..sources import load_source

        doc = load_baseline(baseline) if (not update or baseline.is_file()) else {}
        if doc.get("schema") == "yafsdp.plan/1":
            from .plan_cmd import check_plan

            if update:
                raise YafsdpError(
                    "a plan baseline is written by `yafsdp plan --json`, not --update"
                )
            check_plan(doc, trust_pickle)
            return
        recorded = doc.get("inputs", {})
        inputs = baseline_inputs(doc, overrides)
        source = source or recorded.get("source")
        model = model or recorded.get("model")
        loaded = load_source(source, model=model, trust_pickle=trust_pickle)
        report = inspect_model(loaded, **inputs, model=model)
        current = inspect_view.to_json(report)
        if update:
            _write_atomically(baseline, current + "\n")
            stderr.print(
                f"wrote baseline {baseline} (flat {report.memory.flat_bytes:,} B per rank)"
            )
            _write_page(html, None, report)
            return
        result = compare(
            doc,
            json.loads(current),
            tolerance_percent=tolerance,
            baseline_path=str(baseline),
            inputs=inputs,
        )
        _write_page(html, result, report)  # the CI artifact, written pass or fail
        _render(result, json_out, markdown)
    if not result.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _write_page(html: Path | None, result, report) -> None:
    if html is not None:
        from ..report.html import check_page

        write_html(html, check_page(result, report))


def _render(result, json_out: bool, markdown: bool) -> None:
    from ..report import check as view

    if json_out:
        sys.stdout.write(view.to_json(result) + "\n")
    elif markdown:
        sys.stdout.write(view.to_markdown(result))
    else:
        for renderable in view.to_rich(result):
            stdout.print(renderable)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
