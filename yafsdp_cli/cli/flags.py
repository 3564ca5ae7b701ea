"""Every option the commands share, declared once, and what turns them into options.

A command declares its parameters with these annotations (a command's own options
stay in its module) and builds each piece of the library's options model
(``yafsdp_cli.options``) with that piece's builder below (``layout_from``,
``step_from``, ``memory_from``), naming every value: the pieces validate. Defaults
stay in each command's signature, since commands differ in them (plan's
--param-dtype is bf16, check's options default to what its baseline recorded).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import YafsdpError
from ..gpu_table import NAMES as GPU_NAMES
from ..numbers import (
    MAX_COUNT,
    MAX_GRAD_ACCUM,
    MAX_SEED,
    MAX_SEQ_LEN,
    from_text,
    problem,
)
from .command_kit import stdout

if TYPE_CHECKING:
    from ..options import LayoutOptions, MemoryOptions, StepOptions


def number(low, high, *, whole: bool = True, above: bool = False):
    """A ``typer.Option(parser=...)`` for a number on the command line: one checked
    the way every number is (``yafsdp_cli.numbers``), so ``nan``, ``inf``, ``1e400``
    and an integer of 400 digits are usage errors naming the option, not values."""

    def parse(value):
        got = from_text(value, whole=whole) if isinstance(value, str) else value
        typed = value if isinstance(value, str) else None
        wrong = problem(got, low, high, whole=whole, above=above, typed=typed)
        if wrong is not None:
            raise typer.BadParameter(wrong)
        return int(got) if whole else float(got)

    parse.__name__ = "integer" if whole else "float"  # what --help shows as its type
    return parse


COUNT = number(1, MAX_COUNT)  # ranks, samples, steps, rows: 1 to 2**20

FilterOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        help="Convert parameters matching EXPR (repeatable): linear, embedding, conv, norm, "
        "type:Class, name:GLOB, re:REGEX, dtype:bf16, min-numel:N, all. "
        "Default: every floating-point parameter.",
        metavar="EXPR",
    ),
]
ExcludeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude", help="Do not convert parameters matching EXPR (repeatable).", metavar="EXPR"
    ),
]
UnitOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--unit",
        help="Modules (fnmatch GLOB, outermost match wins) that get flat buffers of their own. "
        "Default: the repeated blocks.",
        metavar="GLOB",
    ),
]
WorldSizeOpt = Annotated[
    int,
    typer.Option(
        "--world-size", "-n", parser=COUNT, metavar="INTEGER", help="Number of ranks to shard for."
    ),
]
AlignOpt = Annotated[
    str,
    typer.Option(
        "--align", help="yafsdp | fsdp | megatron | none | BYTES: parameter starts and padding."
    ),
]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Architecture factory package.module:callable (or path/file.py:callable); "
        "SOURCE then gives its weights.",
        metavar="MODULE:FACTORY",
    ),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Allow loading a pickled nn.Module: this runs code from the file.",
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else.")
]
ExplainOpt = Annotated[
    bool,
    typer.Option(
        "--explain", "-v", help="Also print how each figure was found (JSON always has it)."
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
SourceArg = Annotated[
    str | None,
    typer.Argument(
        help="Weights with an architecture: a Hugging Face folder, a pickled module "
        "(--trust-pickle), or any weights file with --model. Optional with --model.",
        show_default=False,
    ),
]
FormatOpt = Annotated[str, typer.Option("--format", help="table | json | markdown.")]

# the training step
OptimizerOpt = Annotated[
    str | None,
    typer.Option(
        "--optimizer",
        help="adamw | adam | sgd | none (inspect: a DCP checkpoint's own, else adamw).",
    ),
]
OptimizerImplOpt = Annotated[
    str,
    typer.Option(
        "--optimizer-impl",
        help="auto | for-loop | foreach | fused (auto: torch's default for the device).",
    ),
]
BatchOpt = Annotated[
    int,
    typer.Option(
        "--batch", parser=COUNT, metavar="INTEGER", help="Batch size of each micro-batch."
    ),
]
GradAccumOpt = Annotated[
    int,
    typer.Option(
        "--grad-accum",
        parser=number(1, MAX_GRAD_ACCUM),
        metavar="N",
        help="Micro-batches per optimizer step.",
    ),
]
SeqLenOpt = Annotated[
    int | None,
    typer.Option(
        "--seq-len",
        parser=number(1, MAX_SEQ_LEN),
        metavar="INTEGER",
        help="Tokens per sample (LMs; plan: the model's own).",
    ),
]
InputShapeOpt = Annotated[
    str | None,
    typer.Option(
        "--input-shape",
        help="Shape of the model's input, e.g. 2,3,32,32 (default: from the model kind).",
        metavar="D,D,...",
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        parser=number(0, MAX_SEED),
        metavar="INTEGER",
        help="Seed of inputs and loss.",
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu | cuda.")]
TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        help="cpu | cuda: whose kernels the figures are for (default: the device's).",
    ),
]
CheckpointingOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpointing",
        help="none | reentrant | non-reentrant: activation checkpointing of every unit "
        "(transformers models: their own, every layer); selective:op: torchtitan's op-level "
        "policy (mm, attention kernels saved, the rest recomputed); selective:layer=N: every "
        "N-th unit, counted from 1.",
    ),
]
LossOpt = Annotated[
    str | None,
    typer.Option(
        "--loss",
        help="model|ce|fused-ce|chunked-ce[:N]|projection (default: the model's own "
        "where it has one).",
        metavar="LOSS",
    ),
]
ParamDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--param-dtype",
        help="bf16 | fp16 | fp32: the training dtype, 16-bit with float32 masters "
        "(default: as stored, else bf16).",
        metavar="DTYPE",
    ),
]
GradDtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--grad-dtype",
        help="Gradient dtype, e.g. fp32 (default: the parameter's).",
        metavar="DTYPE",
    ),
]

# the GPU the step-time model times steps on
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help=f"{' | '.join(GPU_NAMES)}: times each step; sets --gpu-memory.",
        metavar="NAME",
    ),
]
FreezeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--freeze",
        help="Fine-tuning: freeze parameters matching EXPR (repeatable; --filter's language).",
        metavar="EXPR",
    ),
]
LoraOpt = Annotated[
    str | None,
    typer.Option(
        "--lora",
        help="Fine-tuning: only peft's LoRA adapter trains, e.g. "
        "r=16,alpha=32,targets=q_proj,v_proj or all-linear (the peft extra).",
        metavar="r=N,alpha=A,targets=M,M",
    ),
]
QuantizeOpt = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="Fine-tuning: nf4 | nf4-dq | fp4 | fp4-dq | int8: the frozen linear layers "
        "as bitsandbytes packs them (estimated).",
        metavar="KIND",
    ),
]

# the memory configuration
GpuMemoryOpt = Annotated[
    str,
    typer.Option(
        "--gpu-memory",
        help="Memory per GPU with its unit, e.g. 80GiB or 81559MiB (GB: powers of 1000).",
        show_default=False,
    ),
]
ReserveOpt = Annotated[
    str | None,
    typer.Option(
        "--reserve",
        help="Held beside the allocator per GPU, in one size (default: the parts of --outside).",
        metavar="SIZE",
    ),
]
OutsideOpt = Annotated[
    str | None,
    typer.Option(
        "--outside",
        help="Parts beside the allocator, e.g. context=1GiB,nccl=256MiB (also cublas, "
        "cublaslt; default: each part's rule).",
        metavar="PART=SIZE,...",
    ),
]
MarginOpt = Annotated[
    str | None,
    typer.Option(
        "--margin",
        help="Kept free by the best row: a size or a share, e.g. 2GiB or 5% (default: 3%).",
        metavar="SIZE|N%",
    ),
]
AllocConfOpt = Annotated[
    str | None,
    typer.Option(
        "--alloc-conf",
        help="The allocator's settings to replay, as PYTORCH_CUDA_ALLOC_CONF (default: "
        "that variable).",
    ),
]
RoundBytesOpt = Annotated[
    int,
    typer.Option(
        "--round-bytes",  # checked by the memory piece, as a baseline's is
        help="Allocator rounding of every tensor, in bytes (512: CUDA; 1: exact storage "
        "bytes, as on the CPU).",
        metavar="BYTES",
    ),
]
MasterWeightsOpt = Annotated[
    bool | None,
    typer.Option(
        "--master-weights/--no-master-weights",
        help="float32 master copies of 16-bit parameters (default: on for 16-bit).",
        show_default=False,
    ),
]
FsdpPlacementOpt = Annotated[
    str,
    typer.Option(
        "--fsdp-placement",
        help="dim0 | auto: what the FSDP2 column models; dim0 is fully_shard's default, "
        "auto uses Shard(1) where dim 0 splits unevenly and dim 1 evenly.",
    ),
]


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


# One builder per piece: a command hands each piece's builder the values of its
# options by the piece's field names. A value of None (an option not given; Typer's
# empty list too) keeps the ``base`` piece's: the command's own defaults, or for
# ``check`` what the baseline recorded. A misspelt name is a TypeError at the call,
# and ``tests/cli/test_flags.py`` checks every command's parameters against them.


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None and v != []}


def layout_given(
    *,
    filters: list[str] | None = None,
    excludes: list[str] | None = None,
    units: list[str] | None = None,
    world_size: int | None = None,
    align: str | None = None,
) -> dict[str, Any]:
    """The layout piece's fields given on the command line, as the piece holds them."""
    given = _given(
        {
            "filters": filters,
            "excludes": excludes,
            "units": units,
            "world_size": world_size,
            "align": align,
        }
    )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}


def layout_from(base: LayoutOptions, **given: Any) -> LayoutOptions:
    """``base`` with the layout options given (``layout_given``'s keywords)."""
    return dataclasses.replace(base, **layout_given(**given))


def step_given(
    *,
    optimizer: str | None = None,
    optimizer_impl: str | None = None,
    batch: int | None = None,
    grad_accum: int | None = None,
    seq_len: int | None = None,
    input_shape: str | None = None,
    seed: int | None = None,
    device: str | None = None,
    target: str | None = None,
    checkpointing: str | None = None,
    param_dtype: str | None = None,
    grad_dtype: str | None = None,
    freeze: list[str] | None = None,
    lora: str | None = None,
    quantize: str | None = None,
    loss: str | None = None,
) -> dict[str, Any]:
    """The step piece's fields given on the command line; ``--input-shape`` parsed."""
    given = _given(
        {
            "optimizer": optimizer,
            "optimizer_impl": optimizer_impl,
            "batch": batch,
            "grad_accum": grad_accum,
            "seq_len": seq_len,
            "input_shape": parse_shape(input_shape),
            "seed": seed,
            "device": device,
            "target": target,
            "checkpointing": checkpointing,
            "param_dtype": param_dtype,
            "grad_dtype": grad_dtype,
            "freeze": freeze,
            "lora": lora,
            "quantize": quantize,
            "loss": loss,
        }
    )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}


def step_from(base: StepOptions, **given: Any) -> StepOptions:
    """``base`` with the step options given (``step_given``'s keywords)."""
    return dataclasses.replace(base, **step_given(**given))


def memory_given(
    *,
    gpu_memory: int | None = None,
    reserve: int | None = None,
    outside: tuple[tuple[str, int], ...] | None = None,
    margin: int | None = None,
    master_weights: bool | None = None,
    round_bytes: int | None = None,
    fsdp_placement: str | None = None,
    alloc_conf: str | None = None,
) -> dict[str, Any]:
    """The memory piece's fields given on the command line (sizes in bytes: the
    command parses their text with ``options.sizes``)."""
    return _given(
        {
            "gpu_memory": gpu_memory,
            "reserve": reserve,
            "outside": outside,
            "margin": margin,
            "master_weights": master_weights,
            "round_bytes": round_bytes,
            "fsdp_placement": fsdp_placement,
            "alloc_conf": alloc_conf,
        }
    )


def memory_from(base: MemoryOptions, **given: Any) -> MemoryOptions:
    """``base`` with the memory options given (``memory_given``'s keywords)."""
    return dataclasses.replace(base, **memory_given(**given))


BUILDERS = {"layout": layout_given, "step": step_given, "memory": memory_given}


def render(view, report, fmt: str, *, explain: bool = False, **options: Any) -> None:
    """``report`` through its report module ``view``: JSON, markdown or Rich tables.
    ``explain`` (``--explain``) reaches the terminal's tables only: JSON and markdown
    always carry every note."""
    if fmt == "json":
        sys.stdout.write(view.to_json(report) + "\n")
    elif fmt == "markdown":
        sys.stdout.write(view.to_markdown(report, **options))
    else:
        print_lines(view.to_rich(report, **options, **({"explain": True} if explain else {})))


def print_lines(renderables) -> None:
    """Each renderable on stdout; a ``no_wrap`` line (one holding a path) is left for
    the terminal to wrap, so the path is never folded mid-name."""
    for renderable in renderables:
        stdout.print(renderable, soft_wrap=getattr(renderable, "no_wrap", None) is True)
