"""`yafsdp convert`, `restore`, `reshard`: flat-buffer checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .command_kit import EXIT_CHECK_FAILED, errors_to_exit
from .flags import (
    COUNT,
    AlignOpt,
    ExcludeOpt,
    FilterOpt,
    ForceOpt,
    JsonOpt,
    ModelOpt,
    TrustPickleOpt,
    UnitOpt,
    WorldSizeOpt,
    layout_from,
    print_lines,
)
from .progress import ProgressBar
from .root import app

OutputOpt = Annotated[
    Path,
    typer.Option(
        "--output",
        "-o",
        help="Where to write: a .safetensors file, or a folder with --sharded.",
        show_default=False,
    ),
]
ShardedOpt = Annotated[
    bool,
    typer.Option(
        "--sharded",
        help="Write a folder: one file per rank (slice r of every buffer, plus the kept "
        "tensors) and yafsdp.index.json.",
    ),
]
WeightsOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--weights-only",
        help="Leave out a training checkpoint's optimizer state and other entries: "
        "the weights alone.",
    ),
]
FlatArg = Annotated[
    Path,
    typer.Argument(
        help="A flat checkpoint: a .safetensors file, or a sharded set's folder or index.",
        show_default=False,
    ),
]


@app.command("convert")
def convert_command(
    source: Annotated[
        str | None,
        typer.Argument(
            help="A .safetensors file or index, .pt/.pth/.bin state dict, pickled module, "
            "Hugging Face folder or DCP checkpoint folder. Optional with --model (the "
            "factory's own weights).",
            show_default=False,
        ),
    ] = None,
    output: OutputOpt = ...,
    filters: FilterOpt = None,
    excludes: ExcludeOpt = None,
    units: UnitOpt = None,
    world_size: WorldSizeOpt = 1,
    align: AlignOpt = "yafsdp",
    sharded: ShardedOpt = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read the written checkpoint back and compare every tensor with the source "
            "before it is renamed into place (exit 1 and nothing written on a mismatch).",
        ),
    ] = False,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    weights_only: WeightsOnlyOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Write a flat-buffer checkpoint (one file, or one file per rank with --sharded)."""
    with errors_to_exit():
        from ..checkpoint import convert_checkpoint
        from ..options import LayoutOptions  # here: restore and reshard need no options
        from ..report import checkpoint_view as view

        layout = layout_from(
            LayoutOptions(),
            filters=filters,
            excludes=excludes,
            units=units,
            world_size=world_size,
            align=align,
        )
        with ProgressBar(not json_out) as bar:
            result = convert_checkpoint(
                source,
                output,
                layout,
                model=model,
                trust_pickle=trust_pickle,
                sharded=sharded,
                force=force,
                verify=verify,
                model_check=_model_check if verify else None,
                progress=bar,
                weights_only=weights_only,
            )
        if json_out:
            sys.stdout.write(view.convert_json(result) + "\n")
        else:
            print_lines(view.convert_view(result))
        if not result.written:
            raise typer.Exit(EXIT_CHECK_FAILED)


@app.command("restore")
def restore_command(
    flat: FlatArg,
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="The state dict to write: .safetensors (streamed), or .pt/.pth/.bin "
            "(torch.save; holds the model in memory once), or a folder with --format dcp "
            "or trainer.",
            show_default=False,
        ),
    ],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="safetensors | pt | dcp (a torch.distributed.checkpoint folder that FSDP2 "
            "and torchtitan load) | trainer (the Hugging Face Trainer folder it was "
            "converted from, optimizer state included). Default: from the output's suffix.",
            show_default=False,
        ),
    ] = None,
    weights_only: WeightsOnlyOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Flat-buffer checkpoint back to an ordinary state dict, bit for bit."""
    with errors_to_exit():
        from ..checkpoint import restore_checkpoint
        from ..report import checkpoint_view as view

        with ProgressBar(not json_out) as bar:
            result = restore_checkpoint(
                flat, output, force=force, progress=bar, fmt=fmt, weights_only=weights_only
            )
        if json_out:
            sys.stdout.write(view.restore_json(result) + "\n")
        else:
            print_lines(view.restore_view(result))


@app.command("reshard")
def reshard_command(
    flat: FlatArg,
    world_size: Annotated[
        int,
        typer.Option(
            "--world-size", "-n", parser=COUNT, metavar="INTEGER", help="The new number of ranks."
        ),
    ],
    output: OutputOpt,
    sharded: ShardedOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-split a flat checkpoint for another rank count (no model needed)."""
    with errors_to_exit():
        from ..checkpoint import reshard_checkpoint
        from ..report import checkpoint_view as view

        with ProgressBar(not json_out) as bar:
            result = reshard_checkpoint(
                flat, output, world_size=world_size, sharded=sharded, force=force, progress=bar
            )
        if json_out:
            sys.stdout.write(view.reshard_json(result) + "\n")
        else:
            print_lines(view.reshard_view(result))


def _model_check(loaded, layout):
    """verify's forward/backward check on the convert's ``LayoutOptions`` (one
    process), imported only when --verify asks for it."""
    from ..verify import model_check

    return model_check(loaded, layout)
