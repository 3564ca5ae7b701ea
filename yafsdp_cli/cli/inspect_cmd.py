"""`yafsdp inspect`: flat-buffer layout and per-rank memory report, baseline vs flat."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from .command_kit import (
    AlignOpt,
    ExcludeOpt,
    FilterOpt,
    JsonOpt,
    ModelOpt,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    check_format,
    errors_to_exit,
    stderr,
    stdout,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .root import app


@app.command("inspect")
def inspect_command(
    source: Annotated[
        str | None,
        typer.Argument(
            help="A .safetensors file or index, .pt/.pth/.bin state dict, pickled module, "
            ".pt2 program, Hugging Face folder or DCP checkpoint folder. Optional with --model.",
            show_default=False,
        ),
    ] = None,
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = 1,
    align: AlignOpt = "yafsdp",
    param_dtype: Annotated[
        str | None,
        typer.Option(
            "--param-dtype",
            help="Training dtype: floating parameters are planned and counted in it "
            "(default: as stored).",
            metavar="DTYPE",
        ),
    ] = None,
    grad_dtype: Annotated[
        str | None,
        typer.Option(
            "--grad-dtype", help="Gradient dtype (default: the parameter's).", metavar="DTYPE"
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            "--optimizer",
            help="adamw | adam | sgd | none: optimizer states (default: a DCP checkpoint's "
            "own, else adamw).",
        ),
    ] = None,
    master_weights: Annotated[
        bool | None,
        typer.Option(
            "--master-weights/--no-master-weights",
            help="float32 master copies of 16-bit parameters (default: on for 16-bit).",
            show_default=False,
        ),
    ] = None,
    fsdp_placement: Annotated[
        str,
        typer.Option(
            "--fsdp-placement",
            help="dim0 | auto: what the FSDP2 column models; dim0 is fully_shard's default, "
            "auto uses Shard(1) where dim 0 splits unevenly and dim 1 evenly.",
        ),
    ] = "dim0",
    round_bytes: Annotated[
        int,
        typer.Option(
            "--round-bytes",
            help="Allocator rounding of every tensor, in bytes (512: CUDA; 1: exact storage "
            "bytes, as on the CPU).",
            metavar="BYTES",
        ),
    ] = 512,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    json_out: JsonOpt = False,
    fmt: Annotated[str, typer.Option("--format", help="table | json | markdown.")] = "table",
    show_all: Annotated[
        bool,
        typer.Option("--all", help="Show long tables, shard maps and repeated buffers in full."),
    ] = False,
    html: HtmlOpt = None,
) -> None:
    """Flat-buffer layout and per-rank memory report, baseline vs flat."""
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        from ..inspect.build import inspect_model
        from ..sources import load_source

        loaded = load_source(source, model=model, trust_pickle=trust_pickle)
        report = inspect_model(
            loaded,
            filters=filters or (),
            excludes=excludes or (),
            units=units or (),
            world_size=world_size,
            align=align,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            optimizer=optimizer,
            master_weights=master_weights,
            round_bytes=round_bytes,
            fsdp_placement=fsdp_placement,
            model=model,
        )
        if html is not None:
            from ..report.html import inspect_page

            write_html(html, inspect_page(report))
        _render(report, fmt, show_all)


def _render(report, fmt: str, show_all: bool) -> None:
    from ..report import inspect_view as view

    if fmt == "json":
        sys.stdout.write(view.to_json(report) + "\n")
        if warning := view.warning_line(report):
            stderr.print(warning, markup=False, highlight=False)
    elif fmt == "markdown":
        sys.stdout.write(view.to_markdown(report, show_all=show_all))
    else:
        for renderable in view.to_rich(report, show_all=show_all):
            stdout.print(renderable)
