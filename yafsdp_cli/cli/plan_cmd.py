"""`yafsdp plan`: will training fit, and on how many GPUs?"""

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
    check_format,
    errors_to_exit,
    interrupt_ends_at_once,
    stdout,
)
from .html_out import HtmlOpt, check_html_path, write_html
from .root import app
from .verify_cmd import FormatOpt, OptimizerOpt, SeedOpt, SourceArg

ListOpt = Annotated[str | None, typer.Option(metavar="N,N,...")]


@app.command("plan")
def plan_command(
    source: SourceArg = None,
    gpu_memory: Annotated[
        str, typer.Option("--gpu-memory", help="Memory per GPU, e.g. 80GiB.", show_default=False)
    ] = "",
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
    target: Annotated[
        str,
        typer.Option(
            "--target",
            help="cuda | cpu: whose kernels the fake steps account (cuda: CUDA's attention).",
        ),
    ] = "cuda",
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            "-j",
            help="Fake runs at once, each in its own process (default: as many as the cores "
            "and memory allow; 1: all in this process). The plan is the same for any N.",
        ),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", min=1, help="Tokens per sequence (default: the model's own)."),
    ] = None,
    reserve: Annotated[
        str, typer.Option("--reserve", help="Held outside PyTorch per GPU: CUDA context + NCCL.")
    ] = "2GiB",
    param_dtype: Annotated[
        str, typer.Option("--param-dtype", help="bf16 | fp16 | fp32 training dtype.")
    ] = "bf16",
    grad_dtype: Annotated[
        str | None, typer.Option("--grad-dtype", help="Gradient dtype (default: param dtype).")
    ] = None,
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: Annotated[
        str, typer.Option("--optimizer-impl", help="auto | for-loop | foreach | fused.")
    ] = "foreach",
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
        from ..planning import PlanOptions, parse_ints, parse_size, plan_source

        if not gpu_memory:
            raise YafsdpError("give --gpu-memory, the memory of one GPU, e.g. 80GiB")
        opts = PlanOptions(
            gpu_memory=parse_size(gpu_memory, "--gpu-memory"),
            world_sizes=parse_ints(world_size, "--world-size"),
            micro_batches=parse_ints(micro_batch, "--micro-batch"),
            checkpointing=tuple(dict.fromkeys(c for c in checkpointing.split(",") if c)),
            seq_len=seq_len,
            reserve=parse_size(reserve, "--reserve"),
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            optimizer=optimizer,
            optimizer_impl=optimizer_impl,
            filters=tuple(filters or ()),
            excludes=tuple(excludes or ()),
            units=tuple(units) if units else None,
            align=align,
            target=target,
            jobs=jobs,
            seed=seed,
        )
        with interrupt_ends_at_once():
            report = plan_source(source, model=model, trust_pickle=trust_pickle, opts=opts)
        from ..report import plan_view as view

        if html is not None:
            write_html(html, view.plan_page(report))
        if fmt == "json":
            sys.stdout.write(view.to_json(report) + "\n")
        elif fmt == "markdown":
            sys.stdout.write(view.to_markdown(report))
        else:
            for renderable in view.to_rich(report):
                stdout.print(renderable)


def check_plan(doc: dict, trust_pickle: bool) -> None:
    """``check --baseline PLAN.json``: plan again with the recorded options; exit 1 if
    a configuration that fitted no longer does."""
    import json

    from ..gate.regressions import plan_regressions
    from ..planning import PlanOptions, plan_source
    from ..report import plan_view as view

    recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in doc["options"].items()}
    opts = PlanOptions(**recorded)
    report = plan_source(
        doc.get("source_path"), model=doc.get("model"), trust_pickle=trust_pickle, opts=opts
    )
    lost = plan_regressions(doc, json.loads(view.to_json(report)))
    for line in lost:
        stdout.print(f"regression: {line}", markup=False, highlight=False)
    if lost:
        raise typer.Exit(1)
    stdout.print(f"ok: every configuration that fitted still fits ({len(report.rows)} checked)")
