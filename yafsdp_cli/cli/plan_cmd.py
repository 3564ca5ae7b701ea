"""`yafsdp plan`: will training fit, and on how many GPUs?"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from ..numbers import MAX_JOBS
from .command_kit import check_format, errors_to_exit, interrupt_ends_at_once, stderr
from .flags import (
    AlignOpt,
    AllocConfOpt,
    ExcludeOpt,
    ExplainOpt,
    FilterOpt,
    FormatOpt,
    FreezeOpt,
    GpuMemoryOpt,
    GpuOpt,
    GradDtypeOpt,
    JsonOpt,
    LoraOpt,
    MarginOpt,
    ModelOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    OutsideOpt,
    ParamDtypeOpt,
    QuantizeOpt,
    ReserveOpt,
    SeedOpt,
    SeqLenOpt,
    SourceArg,
    TargetOpt,
    TrustPickleOpt,
    UnitOpt,
    number,
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
            help="World sizes, e.g. 8,16,32 (default: 1,2,4,... up to the first that fits).",
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
    scheme: Annotated[
        str,
        typer.Option(
            "--scheme",
            help="Schemes to plan side by side: flat, fsdp2, zero1, zero2, zero3, ddp, or all.",
            metavar="NAME,NAME,...|all",
        ),
    ] = "flat",
    target: TargetOpt = "cuda",
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            parser=number(1, MAX_JOBS),
            metavar="INTEGER",
            help="Fake runs at once, a process each (default: as the cores and memory "
            "allow); any N gives the same plan.",
        ),
    ] = None,
    gpu: GpuOpt = None,
    gpu_profile: Annotated[
        str | None,
        typer.Option(
            "--gpu-profile",
            help="A GPU profile JSON (`yafsdp calibrate` writes one) in place of --gpu.",
            metavar="FILE",
        ),
    ] = None,
    network: Annotated[
        str | None,
        typer.Option(
            "--network",
            help="Bandwidth between nodes per GPU, e.g. 50GB/s or 400Gbit/s (default 50GB/s).",
            metavar="RATE",
        ),
    ] = None,
    objective: Annotated[
        str | None,
        typer.Option(
            "--objective",
            help="throughput (default) | gpu-hours (with --tokens) | fewest-gpus: what the "
            "best row wins on.",
            metavar="OBJECTIVE",
        ),
    ] = None,
    tokens: Annotated[
        str | None,
        typer.Option("--tokens", help="Tokens to train on, e.g. 2T: the GPU-hours.", metavar="N"),
    ] = None,
    seq_len: SeqLenOpt = None,
    reserve: ReserveOpt = None,
    outside: OutsideOpt = None,
    margin: MarginOpt = None,
    alloc_conf: AllocConfOpt = None,
    param_dtype: ParamDtypeOpt = "bf16",
    grad_dtype: GradDtypeOpt = None,
    freeze: FreezeOpt = None,
    lora: LoraOpt = None,
    quantize: QuantizeOpt = None,
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
    explain: ExplainOpt = False,
) -> None:
    """Will training fit? Memory per rank for each world size, micro-batch and
    checkpointing, and the fastest configuration that fits (docs/plan.md)."""
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        check_html_path(html, source)
        from ..planning import plan_source
        from ..report import plan_view as view

        opts, notes = _options(locals())
        for note in notes:
            stderr.print(f"note: {note}", markup=False, highlight=False)
        with interrupt_ends_at_once():
            report = plan_source(source, model=model, trust_pickle=trust_pickle, opts=opts)
        if html is not None:
            write_html(html, view.plan_page(report))
        render(view, report, fmt, explain=explain)


def _options(a: dict):
    """The command's ``PlanOptions`` from its typed arguments ``a``, and the notes to
    print (how a size was read)."""
    from ..errors import YafsdpError
    from ..options import check_reserve, si_echo
    from ..planning import PlanOptions, gpu_memory_notes, parse_ints, parse_size
    from ..planning.plan_options import parse_count, parse_margin, parse_outside, parse_rate
    from ..planning.reserved_fit import outside_at
    from ..schemes import check_names as check_schemes

    gpu_memory, reserve, margin = a["gpu_memory"], a["reserve"], a["margin"]
    if not (gpu_memory or a["gpu"] or a["gpu_profile"]):
        raise YafsdpError("give --gpu-memory, the memory of one GPU, e.g. 80GiB (or --gpu NAME)")
    if gpu_memory and reserve is not None:  # the error blames the option typed
        check_reserve(
            parse_size(gpu_memory, "--gpu-memory"),
            parse_size(reserve, "--reserve"),
            reserve_typed=True,
        )
    opts = options_from(
        PlanOptions,
        a,
        gpu_memory=parse_size(gpu_memory, "--gpu-memory") if gpu_memory else None,
        network=parse_rate(a["network"], "--network"),
        tokens=parse_count(a["tokens"], "--tokens"),
        world_sizes=parse_ints(a["world_size"], "--world-size"),
        micro_batches=parse_ints(a["micro_batch"], "--micro-batch"),
        checkpointing=tuple(dict.fromkeys(c for c in a["checkpointing"].split(",") if c)),
        reserve=None if reserve is None else parse_size(reserve, "--reserve"),
        outside=parse_outside(a["outside"]),
        margin=None,  # a share of the GPU's memory, known once a named GPU is resolved
        schemes=check_schemes(a["scheme"]),
    )
    if reserve is None and opts.gpu_memory:  # the itemised parts, at their smallest
        check_reserve(opts.gpu_memory, outside_at(opts, 1).total, reserve_typed=False)
    if margin is not None:
        kept = parse_margin(margin, opts.memory.gpu_memory)
        opts = replace(opts, memory=replace(opts.memory, margin=kept))
    notes = list(gpu_memory_notes(gpu_memory)) if gpu_memory else []
    if reserve is not None:
        notes += filter(None, [si_echo(reserve, "--reserve")])
    return opts, notes
