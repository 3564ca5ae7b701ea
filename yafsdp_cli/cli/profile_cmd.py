"""`yafsdp profile`: measured peak memory of a training step, original vs converted."""

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
    interrupt_ends_at_once,
    stdout,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .progress import StageBar
from .root import app
from .verify_cmd import (
    BatchOpt,
    DeviceOpt,
    FormatOpt,
    InputShapeOpt,
    OptimizerOpt,
    SeedOpt,
    SeqLenOpt,
    SourceArg,
    parse_shape,
)


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
    optimizer_impl: Annotated[
        str,
        typer.Option(
            "--optimizer-impl",
            help="auto | for-loop | foreach | fused (auto: torch's default for the device).",
        ),
    ] = "auto",
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = 1,
    align: AlignOpt = "yafsdp",
    batch: BatchOpt = 2,
    seq_len: SeqLenOpt = 16,
    input_shape: InputShapeOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="cpu | cuda: whose kernels the figures are for (default: the device's). "
            "cuda without a GPU needs --fake: CUDA's attention kernels are accounted.",
        ),
    ] = None,
    checkpointing: Annotated[
        str,
        typer.Option(
            "--checkpointing",
            help="none | reentrant | non-reentrant: activation checkpointing of every unit "
            "(transformers models: their own, every layer).",
        ),
    ] = "none",
    modules: Annotated[
        int,
        typer.Option(
            "--modules",
            min=0,
            help="Break the peak's activations down by the modules that made them: top N.",
        ),
    ] = 0,
    param_dtype: Annotated[
        str | None,
        typer.Option(
            "--param-dtype",
            help="bf16 | fp16 | fp32: train in this dtype; 16-bit gets float32 master "
            "weights and optimizer states (default: the weights' dtype).",
        ),
    ] = None,
    grad_dtype: Annotated[
        str | None,
        typer.Option("--grad-dtype", help="fp32: float32 gradients (default: param dtype)."),
    ] = None,
    per_module: Annotated[
        bool, typer.Option("--per-module", help="Add peaks per module (see --depth).")
    ] = False,
    depth: Annotated[
        int,
        typer.Option("--depth", min=1, help="Per-module rows: names with at most DEPTH parts."),
    ] = 3,
    alloc_conf: Annotated[
        str | None,
        typer.Option(
            "--alloc-conf",
            help="With --target cuda: the caching allocator's settings for the reserved "
            "replay, PYTORCH_CUDA_ALLOC_CONF syntax (default: that variable).",
        ),
    ] = None,
    json_out: JsonOpt = False,
    fmt: FormatOpt = "table",
    html: HtmlOpt = None,
) -> None:
    """Measured peak memory of a training step, original vs converted.

    With --world-size N the converted model runs as rank 0 of N: its parameters,
    gradients and optimizer state are shards, each unit gathered while it runs.
    """
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        from ..profiling import ProfileOptions, profile_source
        from ..profiling.profiler import STAGES

        opts = ProfileOptions(
            optimizer=optimizer,
            optimizer_impl=optimizer_impl,
            filters=tuple(filters or ()),
            excludes=tuple(excludes or ()),
            units=tuple(units) if units else None,
            world_size=world_size,
            align=align,
            batch=batch,
            seq_len=seq_len,
            input_shape=parse_shape(input_shape),
            seed=seed,
            fake=fake,
            per_module=per_module,
            depth=depth,
            modules=modules,
            device=device,
            target=target,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            checkpointing=checkpointing,
            alloc_conf=alloc_conf,
        )
        with StageBar(fmt != "json", "profile", total=len(STAGES)) as bar, interrupt_ends_at_once():
            report = profile_source(
                source, model=model, trust_pickle=trust_pickle, opts=opts, progress=bar
            )
        if html is not None:
            from ..report.html import profile_page

            write_html(html, profile_page(report))
        _render(report, fmt)


def _render(report, fmt: str) -> None:
    from ..report import profile_view as view

    if fmt == "json":
        sys.stdout.write(view.to_json(report) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(view.to_markdown(report))
    else:
        for renderable in view.to_rich(report):
            stdout.print(renderable)
