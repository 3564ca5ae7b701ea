"""`yafsdp plan`: will training fit, and on how many GPUs?"""

from __future__ import annotations

from typing import Annotated

import typer

from .command_kit import check_format, errors_to_exit, interrupt_ends_at_once, stderr
from .flags import (
    AlignOpt,
    ExcludeOpt,
    FilterOpt,
    FormatOpt,
    GpuMemoryOpt,
    GradDtypeOpt,
    JsonOpt,
    ModelOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    ParamDtypeOpt,
    ReserveOpt,
    SeedOpt,
    SeqLenOpt,
    SourceArg,
    TargetOpt,
    TrustPickleOpt,
    UnitOpt,
    options_from,
    render,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .root import app


@app.command("plan")
def plan_command(
    source: SourceArg = None,
    gpu_memory: GpuMemoryOpt = "",
    world_size: Annotated[
        str | None,
        typer.Option(
            "--world-size",
            help="World sizes, e.g. 8,16,32 (default: 1,2,4,...,512 up to the first where "
            "everything fits).",
            metavar="N,N,...",
        ),
    ] = None,
    micro_batch: Annotated[
        str, typer.Option("--micro-batch", help="Micro-batch sizes.", metavar="N,N,...")
    ] = "1,2,4,8",
    checkpointing: Annotated[
        str,
        typer.Option(
            "--checkpointing",
            help="Activation checkpointing of every unit to try: none, reentrant, non-reentrant.",
            metavar="MODE,MODE,...",
        ),
    ] = "none,non-reentrant",
    target: TargetOpt = "cuda",
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            help="Fake runs at once, each in its own process (default: as many as the cores "
            "and memory allow; 1: all in this process). The plan is the same for any N.",
        ),
    ] = None,
    seq_len: SeqLenOpt = None,
    reserve: ReserveOpt = None,
    param_dtype: ParamDtypeOpt = "bf16",
    grad_dtype: GradDtypeOpt = None,
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "foreach",
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    align: AlignOpt = "yafsdp",
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
    fmt: FormatOpt = "table",
    html: HtmlOpt = None,
) -> None:
    """Will training fit? Peak per rank for each world size, micro-batch and checkpointing.

    Persistent bytes come from the memory model; activations and temporaries from
    fake runs of the converted model's training step (FakeTensorMode).
    """
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        from ..errors import YafsdpError
        from ..options import check_reserve, si_echo
        from ..planning import (
            DEFAULT_RESERVE,
            PlanOptions,
            gpu_memory_notes,
            parse_ints,
            parse_size,
            plan_source,
        )
        from ..report import plan_view as view

        if not gpu_memory:
            raise YafsdpError("give --gpu-memory, the memory of one GPU, e.g. 80GiB")
        gpu_bytes = parse_size(gpu_memory, "--gpu-memory")
        reserve_bytes = DEFAULT_RESERVE if reserve is None else parse_size(reserve, "--reserve")
        check_reserve(gpu_bytes, reserve_bytes, reserve_typed=reserve is not None)
        opts = options_from(
            PlanOptions,
            locals(),
            gpu_memory=gpu_bytes,
            world_sizes=parse_ints(world_size, "--world-size"),
            micro_batches=parse_ints(micro_batch, "--micro-batch"),
            checkpointing=tuple(dict.fromkeys(c for c in checkpointing.split(",") if c)),
            reserve=reserve_bytes,
        )
        reserve_echo = si_echo(reserve, "--reserve") if reserve is not None else None
        for note in (*gpu_memory_notes(gpu_memory), *filter(None, [reserve_echo])):
            stderr.print(f"note: {note}", markup=False, highlight=False)
        with interrupt_ends_at_once():
            report = plan_source(source, model=model, trust_pickle=trust_pickle, opts=opts)
        if html is not None:
            write_html(html, view.plan_page(report))
        render(view, report, fmt)
