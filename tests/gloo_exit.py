"""A rank of a 2-process verify that reports the gloo threads its group leaves behind
(spawned by test_verify_dist; a module of its own so that spawn can import it)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch.distributed as dist
from helpers import options


def gloo_threads() -> int:
    """Threads of this process named as ProcessGroupGloo's workers."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            count += Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "pt_gloo_runloop"
    return count


def worker(rank: int, tmp: str) -> None:
    from yafsdp_cli.sources import load_source
    from yafsdp_cli.verify.dist import _init, leave_group, verify_this_rank
    from yafsdp_cli.verify.harness import VerifyOptions

    _init(rank, 2, f"file://{tmp}/store", "cpu")
    # --model builds the architecture on the meta device, which imports dynamo
    src = load_source("sample_models/gpt.safetensors", model="sample_models.models:gpt")
    report = verify_this_rank(src, options(VerifyOptions, world_size=2, steps=1))
    dist.barrier()
    during = gloo_threads()
    leave_group()
    Path(tmp, f"rank{rank}").write_text(f"{int(report.ok)} {during} {gloo_threads()}")
