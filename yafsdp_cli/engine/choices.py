"""The named choices of a training step and of the memory model, and their checks.

Torch-free, so that the options model (``yafsdp_cli.options``) validates a choice
without importing torch; the runtime that acts on a choice (``train_step``,
``idioms``, ``memory.fsdp2``) reads its list from here too.
"""

from __future__ import annotations

from ..errors import YafsdpError

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")
CHECKPOINTING = ("none", "reentrant", "non-reentrant")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("dim0", "auto")  # FSDP2: fully_shard's dim-0 split, or Shard(1) where better


def check_optimizer(kind: str, impl: str = "for-loop") -> None:
    if kind not in OPTIMIZERS:
        raise YafsdpError(f"--optimizer {kind!r} is not one of {'|'.join(OPTIMIZERS)}")
    if impl not in OPTIMIZER_IMPLS:
        raise YafsdpError(f"--optimizer-impl {impl!r} is not one of {'|'.join(OPTIMIZER_IMPLS)}")


def check_checkpointing(mode: str) -> None:
    if mode not in CHECKPOINTING:
        raise YafsdpError(f"--checkpointing {mode!r} is not one of {'|'.join(CHECKPOINTING)}")


def check_device(flag: str, device: str) -> None:
    if device not in DEVICES:
        raise YafsdpError(f"{flag} {device!r} is not cpu or cuda")


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise YafsdpError(f"--fsdp-placement {placement!r} is not one of {'|'.join(PLACEMENTS)}")
    return placement
