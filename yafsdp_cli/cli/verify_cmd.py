"""`yafsdp verify`: forward/backward check of the converted model against the original."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import YafsdpError
from ..numbers import MAX_TOLERANCE
from .command_kit import (
    EXIT_CHECK_FAILED,
    EXIT_NOT_REPRODUCIBLE,
    EXIT_OK,
    check_format,
    errors_to_exit,
    stderr,
)
from .flags import (
    COUNT,
    AlignOpt,
    BatchOpt,
    CheckpointingOpt,
    DeviceOpt,
    ExcludeOpt,
    FilterOpt,
    FormatOpt,
    InputShapeOpt,
    JsonOpt,
    ModelOpt,
    OptimizerOpt,
    SeedOpt,
    SeqLenOpt,
    SourceArg,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    layout_from,
    number,
    render,
    step_from,
)
from .progress import WaitBar
from .root import app

CompileOpt = Annotated[
    bool, typer.Option("--compile", help="torch.compile both models (inductor) and compare.")
]
BlocksOpt = Annotated[
    str | None,
    typer.Option(
        "--blocks",
        help="Verify the model built with some of its repeated blocks, real weights: a "
        "count (2 = first and last), indices (0,17,31) or all. Default: every block, or "
        "the most that fit in memory.",
        metavar="SPEC",
    ),
]


@app.command("verify")
def verify_command(
    source: SourceArg = None,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    steps: Annotated[
        int, typer.Option("--steps", parser=COUNT, metavar="INTEGER", help="Optimizer steps.")
    ] = 3,
    micro_batches: Annotated[
        int,
        typer.Option(
            "--micro-batches",
            parser=COUNT,
            metavar="INTEGER",
            help="Accumulated micro-batches per step (and rank).",
        ),
    ] = 2,
    optimizer: OptimizerOpt = "adamw",
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = 1,
    align: AlignOpt = "yafsdp",
    atol: Annotated[
        float | None,
        typer.Option(
            "--atol",
            parser=number(0, MAX_TOLERANCE, whole=False),
            metavar="FLOAT",
            help="Absolute tolerance, every dtype (default: exact on CPU).",
        ),
    ] = None,
    rtol: Annotated[
        float | None,
        typer.Option(
            "--rtol",
            parser=number(0, MAX_TOLERANCE, whole=False),
            metavar="FLOAT",
            help="Relative tolerance, every dtype (default: exact on CPU).",
        ),
    ] = None,
    batch: BatchOpt = 2,
    seq_len: SeqLenOpt = 16,
    input_shape: InputShapeOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    top: Annotated[
        int, typer.Option("--top", parser=COUNT, metavar="INTEGER", help="Worst tensors to list.")
    ] = 10,
    checkpointing: CheckpointingOpt = "none",
    compile_: CompileOpt = False,
    blocks: BlocksOpt = None,
    json_out: JsonOpt = False,
    fmt: FormatOpt = "table",
) -> None:
    """Forward/backward check of the converted model against the original.

    With --world-size N the check runs on N processes (gloo on CPU, NCCL with
    --device cuda), launched here; under torchrun it runs as that rank instead.
    Exit 0 if everything matches, 1 on a mismatch, 2 on bad input, 3 if the
    original model does not reproduce its own numbers when run again (no verdict).
    """
    with errors_to_exit():
        fmt = check_format(fmt, json_out)
        from ..report import verify_view as view
        from ..verify import MemoryBudgetError, VerifyOptions, verify_source
        from ..verify.dist import is_primary, launched_by_torchrun

        base = VerifyOptions()
        opts = VerifyOptions(
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
                batch=batch,
                seq_len=seq_len,
                input_shape=input_shape,
                seed=seed,
                device=device,
                checkpointing=checkpointing,
            ),
            steps=steps,
            micro_batches=micro_batches,
            atol=atol,
            rtol=rtol,
            top=top,
            compile=compile_,
            blocks=blocks,
        )
        # The estimate is printed once the run has a verdict, never before an error (a
        # forward that fails on --input-shape fails inside the run); while it runs, the
        # waiting bar (a terminal only) names it.
        bar = WaitBar(fmt != "json" and not launched_by_torchrun(), "verify")

        def header(run_plan) -> None:
            bar(view.waiting_words(run_plan.budget), 0, None)

        try:
            with bar:
                report = verify_source(
                    source, model=model, trust_pickle=trust_pickle, opts=opts, on_plan=header
                )
        except MemoryBudgetError as exc:
            raise YafsdpError(view.refusal(exc.budget, exc.suggestions)) from None
        if is_primary():
            if report.budget is not None:
                line = view.header_line(report.budget, report.blocks)
                stderr.print(line, markup=False, soft_wrap=False)  # wrapped between words
            render(view, report, fmt)
    raise typer.Exit(exit_code(report))


def exit_code(report) -> int:
    if not report.reproducible:
        return EXIT_NOT_REPRODUCIBLE
    return EXIT_OK if report.ok else EXIT_CHECK_FAILED
