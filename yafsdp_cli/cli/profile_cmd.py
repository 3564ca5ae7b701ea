"""`yafsdp profile`: measured peak memory of a training step, original vs converted."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import YafsdpError
from ..numbers import MAX_COUNT, shown
from .command_kit import check_format, errors_to_exit, interrupt_ends_at_once
from .flags import (
    COUNT,
    AlignOpt,
    AllocConfOpt,
    BatchOpt,
    CheckpointingOpt,
    DeviceOpt,
    ExcludeOpt,
    ExplainOpt,
    FilterOpt,
    FormatOpt,
    FreezeOpt,
    GradAccumOpt,
    GradDtypeOpt,
    InputShapeOpt,
    JsonOpt,
    LoraOpt,
    LossOpt,
    ModelOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    ParamDtypeOpt,
    QuantizeOpt,
    SeedOpt,
    SeqLenOpt,
    SourceArg,
    TargetOpt,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    layout_from,
    memory_from,
    number,
    render,
    step_from,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .progress import StageBar
from .root import app


@app.command("profile")
def profile_command(
    source: SourceArg = None,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    fake: Annotated[
        bool,
        typer.Option("--fake", help="Run under FakeTensorMode: shapes only, no memory used."),
    ] = False,
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "auto",
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = 1,
    align: AlignOpt = "yafsdp",
    batch: BatchOpt = 2,
    grad_accum: GradAccumOpt = 1,
    seq_len: SeqLenOpt = 16,
    input_shape: InputShapeOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    target: TargetOpt = None,
    checkpointing: CheckpointingOpt = "none",
    loss: LossOpt = None,
    modules: Annotated[
        int,
        typer.Option(
            "--modules",
            parser=number(0, MAX_COUNT),
            metavar="INTEGER",
            help="Break the peak's activations down by the modules that made them: top N.",
        ),
    ] = 0,
    param_dtype: ParamDtypeOpt = None,
    grad_dtype: GradDtypeOpt = None,
    freeze: FreezeOpt = None,
    lora: LoraOpt = None,
    quantize: QuantizeOpt = None,
    per_module: Annotated[
        bool, typer.Option("--per-module", help="Add peaks per module (see --depth).")
    ] = False,
    depth: Annotated[
        int,
        typer.Option(
            "--depth",
            parser=COUNT,
            metavar="INTEGER",
            help="Per-module rows: names with at most DEPTH parts.",
        ),
    ] = 3,
    trace: Annotated[
        str,
        typer.Option(
            "--trace",
            metavar="periodic|whole",
            help="--fake: trace one period of the layer stack and repeat it, checked "
            "against a trace one period deeper, and three micro-batches of --grad-accum "
            "(periodic), or trace every layer and micro-batch (whole).",
        ),
    ] = "periodic",
    alloc_conf: AllocConfOpt = None,
    json_out: JsonOpt = False,
    fmt: FormatOpt = "table",
    html: HtmlOpt = None,
    explain: ExplainOpt = False,
) -> None:
    """Measured peak memory of a training step, original vs converted.

    With --world-size N the converted model runs as rank 0 of N: its parameters,
    gradients and optimizer state are shards, each unit gathered while it runs.
    """
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        if trace not in ("periodic", "whole"):
            raise YafsdpError(f"--trace {shown(trace)!r}: give periodic or whole")
        from ..profiling import ProfileOptions, profile_source
        from ..profiling.profiler import STAGES
        from ..report import profile_view as view

        base = ProfileOptions()
        opts = ProfileOptions(
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
                optimizer=optimizer,
                optimizer_impl=optimizer_impl,
                batch=batch,
                grad_accum=grad_accum,
                seq_len=seq_len,
                input_shape=input_shape,
                seed=seed,
                device=device,
                target=target,
                checkpointing=checkpointing,
                loss=loss,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                freeze=freeze,
                lora=lora,
                quantize=quantize,
            ),
            memory=memory_from(base.memory, alloc_conf=alloc_conf),
            fake=fake,
            per_module=per_module,
            depth=depth,
            modules=modules,
            periodic=trace == "periodic",
        )
        with StageBar(fmt != "json", "profile", total=len(STAGES)) as bar, interrupt_ends_at_once():
            report = profile_source(
                source, model=model, trust_pickle=trust_pickle, opts=opts, progress=bar
            )
        if html is not None:
            from ..report.html_pages import profile_page

            write_html(html, profile_page(report))
        render(view, report, fmt, explain=explain)
