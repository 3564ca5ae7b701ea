"""`yafsdp calibrate`: measure this machine's GPU into a profile that `plan` reads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..numbers import MAX_SEQ_LEN
from .command_kit import errors_to_exit, stdout
from .flags import (
    COUNT,
    BatchOpt,
    CheckpointingOpt,
    GpuOpt,
    ModelOpt,
    OptimizerImplOpt,
    OptimizerOpt,
    ParamDtypeOpt,
    SeedOpt,
    SourceArg,
    TrustPickleOpt,
    number,
)
from .root import app


@app.command("calibrate")
def calibrate_command(
    source: SourceArg = None,
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="The GPU profile to write (JSON).", show_default=False),
    ] = Path("gpu-profile.json"),
    gpu: GpuOpt = None,
    batch: BatchOpt = 4,
    seq_len: Annotated[
        int,
        typer.Option(
            "--seq-len",
            parser=number(1, MAX_SEQ_LEN),
            metavar="INTEGER",
            help="Tokens per sample.",
        ),
    ] = 2048,
    param_dtype: ParamDtypeOpt = "bf16",
    optimizer: OptimizerOpt = "adamw",
    optimizer_impl: OptimizerImplOpt = "fused",
    checkpointing: CheckpointingOpt = "none",
    steps: Annotated[
        int, typer.Option("--steps", parser=COUNT, metavar="INTEGER", help="Measured steps.")
    ] = 10,
    model: ModelOpt = None,
    trust_pickle: TrustPickleOpt = False,
    seed: SeedOpt = 0,
) -> None:
    """Measure this GPU (matrix products at the model's shapes, HBM, one real training
    step) into a GPU profile for `yafsdp plan --gpu-profile`.

    --gpu names the table's row whose datasheet figures the efficiencies are taken over
    (default: the row of this device's name).
    """
    with errors_to_exit():
        import torch

        from ..errors import YafsdpError

        if not torch.cuda.is_available():
            raise YafsdpError(
                "calibrate measures a CUDA GPU and torch sees none here "
                "(torch.cuda.is_available() is False); run it on the machine plan should time"
            )
        from ..profiling import ProfileOptions
        from ..report.calibrate_view import summary_lines
        from ..sources import load_source
        from ..timing import gpu_spec
        from ..timing.calibrate import measure, table_gpu
        from ..timing.gpu_profile import write_profile

        base = gpu_spec(gpu) if gpu else table_gpu(torch.cuda.get_device_name())
        opts = ProfileOptions(
            device="cuda",
            target="cuda",
            batch=batch,
            seq_len=seq_len,
            param_dtype=param_dtype,
            optimizer=optimizer,
            optimizer_impl=optimizer_impl,
            checkpointing=checkpointing or "none",
            seed=seed,
        )
        loaded = load_source(source, model=model, trust_pickle=trust_pickle)
        found = measure(loaded, opts, "cuda", base, steps=steps)
        write_profile(out, found.profile)
        for line in summary_lines(found, str(out)):
            stdout.print(line)
