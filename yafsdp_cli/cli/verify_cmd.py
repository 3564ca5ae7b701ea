"""`yafsdp verify`: forward/backward check of the converted model against the original."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ..errors import YafsdpError
from .command_kit import (
    EXIT_CHECK_FAILED,
    EXIT_NOT_REPRODUCIBLE,
    EXIT_OK,
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
from .progress import WaitBar
from .root import app

SourceArg = Annotated[
    str | None,
    typer.Argument(
        help="Weights with an architecture: a Hugging Face folder, a pickled module "
        "(--trust-pickle), or any weights file with --model. Optional with --model.",
        show_default=False,
    ),
]
OptimizerOpt = Annotated[
    str, typer.Option("--optimizer", help="adamw | adam | sgd | none (foreach=False).")
]
BatchOpt = Annotated[int, typer.Option("--batch", min=1, help="Batch size of each micro-batch.")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", min=1, help="Tokens per sample (LMs).")]
InputShapeOpt = Annotated[
    str | None,
    typer.Option(
        "--input-shape",
        help="Shape of the model's input, e.g. 2,3,32,32 (default: from the model kind).",
        metavar="D,D,...",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the inputs and the loss.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu | cuda.")]
CheckpointingOpt = Annotated[
    str,
    typer.Option(
        "--checkpointing",
        help="Activation checkpointing of every unit on both models: none | reentrant | "
        "non-reentrant (transformers models through their own activation_checkpointing_enable).",
    ),
]
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
FormatOpt = Annotated[str, typer.Option("--format", help="table | json | markdown.")]


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``"2,3,32,32"`` (or ``2x3x32x32``) -> (2, 3, 32, 32)."""
    if text is None:
        return None
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise YafsdpError(f"--input-shape {text!r} is not positive integers like 2,3,32,32")
    return shape


@app.command("verify")
def verify_command(
    source: SourceArg = None,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 3,
    micro_batches: Annotated[
        int,
        typer.Option(
            "--micro-batches", min=1, help="Accumulated micro-batches per step (and rank)."
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
        typer.Option("--atol", help="Absolute tolerance, every dtype (default: exact on CPU)."),
    ] = None,
    rtol: Annotated[
        float | None,
        typer.Option("--rtol", help="Relative tolerance, every dtype (default: exact on CPU)."),
    ] = None,
    batch: BatchOpt = 2,
    seq_len: SeqLenOpt = 16,
    input_shape: InputShapeOpt = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    top: Annotated[int, typer.Option("--top", min=1, help="Worst tensors to list.")] = 10,
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
        from ..verify import VerifyOptions, verify_source
        from ..verify.dist import is_primary, launched_by_torchrun

        opts = VerifyOptions(
            steps=steps,
            micro_batches=micro_batches,
            optimizer=optimizer,
            filters=tuple(filters or ()),
            excludes=tuple(excludes or ()),
            units=tuple(units) if units else None,
            world_size=world_size,
            align=align,
            atol=atol,
            rtol=rtol,
            batch=batch,
            seq_len=seq_len,
            input_shape=parse_shape(input_shape),
            seed=seed,
            device=device,
            top=top,
            checkpointing=checkpointing,
            compile=compile_,
            blocks=blocks,
        )
        # the ranks are other processes: a pulsing bar while they run, none under torchrun
        waiting = world_size > 1 and fmt != "json" and not launched_by_torchrun()
        title = f"verify on {world_size} ranks, {steps} steps"
        from ..report import verify_view as view
        from ..verify import MemoryBudgetError

        def header(run_plan) -> None:
            if is_primary():
                stderr.print(view.header_line(run_plan.budget, run_plan.blocks), markup=False)

        try:
            with WaitBar(waiting, title):
                report = verify_source(
                    source, model=model, trust_pickle=trust_pickle, opts=opts, on_plan=header
                )
        except MemoryBudgetError as exc:
            raise YafsdpError(view.refusal(exc.budget, exc.suggestions)) from None
        if is_primary():
            _render(report, fmt)
    raise typer.Exit(exit_code(report))


def exit_code(report) -> int:
    if not report.reproducible:
        return EXIT_NOT_REPRODUCIBLE
    return EXIT_OK if report.ok else EXIT_CHECK_FAILED


def _render(report, fmt: str) -> None:
    from ..report import verify_view as view

    if fmt == "json":
        sys.stdout.write(view.to_json(report) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(view.to_markdown(report))
    else:
        for renderable in view.to_rich(report):
            stdout.print(renderable)
