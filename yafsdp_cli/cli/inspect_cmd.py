"""`yafsdp inspect`: flat-buffer layout and per-rank memory report, baseline vs flat."""

from __future__ import annotations

from typing import Annotated

import typer

from .command_kit import check_format, errors_to_exit, stderr
from .flags import (
    AlignOpt,
    ExcludeOpt,
    ExplainOpt,
    FilterOpt,
    FormatOpt,
    FreezeOpt,
    FsdpPlacementOpt,
    GradDtypeOpt,
    JsonOpt,
    LoraOpt,
    MasterWeightsOpt,
    ModelOpt,
    OptimizerOpt,
    ParamDtypeOpt,
    QuantizeOpt,
    RoundBytesOpt,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    layout_from,
    memory_from,
    render,
    step_from,
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
    param_dtype: ParamDtypeOpt = None,
    grad_dtype: GradDtypeOpt = None,
    freeze: FreezeOpt = None,
    lora: LoraOpt = None,
    quantize: QuantizeOpt = None,
    optimizer: OptimizerOpt = None,
    master_weights: MasterWeightsOpt = None,
    fsdp_placement: FsdpPlacementOpt = "dim0",
    round_bytes: RoundBytesOpt = 512,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    json_out: JsonOpt = False,
    fmt: FormatOpt = "table",
    show_all: Annotated[
        bool,
        typer.Option("--all", help="Show long tables, shard maps and repeated buffers in full."),
    ] = False,
    html: HtmlOpt = None,
    explain: ExplainOpt = False,
) -> None:
    """Flat-buffer layout and per-rank memory report, baseline vs flat."""
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        from ..inspection.build import inspect_model
        from ..inspection.inspect_options import InspectOptions
        from ..report import inspect_view as view
        from ..sources import load_source

        base = InspectOptions()
        opts = InspectOptions(
            layout=layout_from(
                base.layout,
                filters=filters,
                excludes=excludes,
                units=units,
                world_size=world_size,
                align=align,
            ),
            step=step_from(
                base.step,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                freeze=freeze,
                lora=lora,
                quantize=quantize,
                optimizer=optimizer,
            ),
            memory=memory_from(
                base.memory,
                master_weights=master_weights,
                fsdp_placement=fsdp_placement,
                round_bytes=round_bytes,
            ),
        )
        loaded = load_source(source, model=model, trust_pickle=trust_pickle)
        report = inspect_model(loaded, opts, model=model)
        if html is not None:
            from ..report.html_pages import inspect_page

            write_html(html, inspect_page(report))
        render(view, report, fmt, show_all=show_all, explain=explain)
        if fmt == "json" and (warning := view.warning_line(report)):
            stderr.print(warning, markup=False, highlight=False)
