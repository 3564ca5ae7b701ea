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
    GradAccumOpt,
    GradDtypeOpt,
    JsonOpt,
    LoraOpt,
    LossOpt,
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
    layout_from,
    memory_from,
    number,
    render,
    step_from,
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
    grad_accum: GradAccumOpt = 1,
    checkpointing: Annotated[
        str,
        typer.Option(
            "--checkpointing",
            help="Activation checkpointing to try: none, reentrant, non-reentrant, "
            "selective:op, selective:layer=N (docs/plan.md).",
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
            help="Fake runs at once, a process each (default: as the cores allow); any "
            "N gives the same plan.",
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
    loss: LossOpt = None,
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
        from ..errors import YafsdpError
        from ..options import LayoutOptions
        from ..options.sizes import memory_sizes
        from ..planning import PlanOptions, parse_ints, plan_source
        from ..planning.plan_options import PLAN_MEMORY, PLAN_STEP, parse_count, parse_rate
        from ..report import plan_view as view
        from ..schemes import check_names as check_schemes

        if not (gpu_memory or gpu or gpu_profile):
            raise YafsdpError(
                "give --gpu-memory, the memory of one GPU, e.g. 80GiB (or --gpu NAME)"
            )
        sizes = memory_sizes(gpu_memory=gpu_memory, reserve=reserve, outside=outside)
        opts = PlanOptions(
            layout=layout_from(
                LayoutOptions(), filters=filters, excludes=excludes, units=units, align=align
            ),
            step=step_from(
                PLAN_STEP,
                seq_len=seq_len,
                grad_accum=grad_accum,
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                freeze=freeze,
                lora=lora,
                quantize=quantize,
                optimizer=optimizer,
                optimizer_impl=optimizer_impl,
                target=target,
                seed=seed,
                loss=loss,
            ),
            # --margin, a share of the GPU's memory, once a named GPU is resolved
            memory=memory_from(
                PLAN_MEMORY,
                gpu_memory=sizes.gpu_memory,
                reserve=sizes.reserve,
                outside=sizes.outside,
                alloc_conf=alloc_conf,
            ),
            world_sizes=parse_ints(world_size, "--world-size"),
            micro_batches=parse_ints(micro_batch, "--micro-batch"),
            checkpointing=tuple(dict.fromkeys(c for c in checkpointing.split(",") if c)),
            jobs=jobs,
            schemes=check_schemes(scheme),
            gpu=gpu,
            gpu_profile=gpu_profile,
            network=parse_rate(network, "--network"),
            objective=objective,
            tokens=parse_count(tokens, "--tokens"),
        )
        opts = _held_and_margin(opts, margin)
        notes = sizes.notes
        for note in notes:
            stderr.print(f"note: {note}", markup=False, highlight=False)
        with interrupt_ends_at_once():
            report = plan_source(source, model=model, trust_pickle=trust_pickle, opts=opts)
        if html is not None:
            write_html(html, view.plan_page(report))
        render(view, report, fmt, explain=explain)


def _held_and_margin(opts, margin: str | None):
    """``opts`` once the GPU's memory is known: the itemised memory beside the
    allocator leaves room on it (``--reserve`` beside ``--gpu-memory`` is checked as
    the sizes are read), and ``--margin`` in bytes."""
    from ..options import check_reserve
    from ..options.sizes import parse_margin
    from ..planning.reserved_fit import outside_at

    memory = opts.memory
    if memory.reserve is None:  # the itemised parts, at their smallest
        check_reserve(memory.gpu_memory, outside_at(opts, 1).total, reserve_typed=False)
    if margin is None:
        return opts
    return replace(opts, memory=replace(memory, margin=parse_margin(margin, memory.gpu_memory)))
