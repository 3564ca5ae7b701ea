"""A training checkpoint's own optimizer state, against what the memory model counts.

A DCP checkpoint (``sources.dcp_folder``) says from its metadata alone which optimizer states
it holds, in which dtype, for how many parameters. ``inspect`` then takes the
optimizer from the checkpoint when ``--optimizer`` is not given, and reports the
measured bytes beside the memory model's figure for the same parameters, so a
difference (states kept in bf16, an optimizer with other states) is visible instead
of assumed away. The per-rank tables stay the memory model's: a checkpoint holds
whole tensors, not what any one rank allocates.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import dtypes
from ..engine.layout import Layout
from ..memory.estimate import OPTIMIZER_STATES, MemoryConfig
from ..sources.state import CheckpointState

DEFAULT_OPTIMIZER = "adamw"


@dataclass(frozen=True, slots=True)
class StoredState:
    """What the checkpoint holds besides the weights (bytes of whole tensors)."""

    checkpoint: CheckpointState
    optimizer_from_checkpoint: bool  # --optimizer was not given: the checkpoint's kind
    measured_state_bytes: int  # optimizer states in the checkpoint, step counters excluded
    modeled_state_bytes: int  # the memory model's states for every trainable parameter


def checkpoint_state(loaded) -> CheckpointState | None:
    state = getattr(loaded, "extra", {}).get("checkpoint_state")
    return state if isinstance(state, CheckpointState) else None


def resolve_optimizer(loaded, optimizer: str | None) -> tuple[str, bool]:
    """``--optimizer``, else the checkpoint's own kind, else AdamW; and whether the
    checkpoint decided it."""
    if optimizer is not None:
        return optimizer, False
    state = checkpoint_state(loaded)
    if state is not None and state.optimizer_kind is not None:
        return state.optimizer_kind, True
    return DEFAULT_OPTIMIZER, False


def modeled_state_bytes(layout: Layout, cfg: MemoryConfig) -> int:
    """Optimizer-state bytes the memory model counts for the whole model (unsharded,
    before allocation rounding): states per element x each parameter's state size."""
    states = OPTIMIZER_STATES[cfg.optimizer]
    sizes = [(e.numel, e.dtype) for b in layout.buffers if b.requires_grad for e in b.entries]
    sizes += [(t.numel, t.dtype) for t in layout.kept if t.is_param and t.requires_grad]
    return sum(states * n * cfg.state_itemsize(d) for n, d in sizes if dtypes.is_floating(d))


def stored_state(loaded, layout: Layout, cfg: MemoryConfig, decided: bool) -> StoredState | None:
    state = checkpoint_state(loaded)
    if state is None:
        return None
    return StoredState(
        checkpoint=state,
        optimizer_from_checkpoint=decided,
        measured_state_bytes=state.state_bytes,
        modeled_state_bytes=modeled_state_bytes(layout, cfg),
    )


def stored_notes(stored: StoredState | None, cfg: MemoryConfig) -> tuple[str, ...]:
    if stored is None or not stored.checkpoint.optimizer:
        return ()
    state = stored.checkpoint
    groups = [g for g in state.optimizer if g.name != "step"]
    what = ", ".join(f"{g.name} ({'/'.join(g.dtypes)})" for g in groups) or "no states"
    notes = []
    if stored.optimizer_from_checkpoint:
        notes.append(f"--optimizer not given: {cfg.optimizer}, from the checkpoint's state")
    measured, modeled = stored.measured_state_bytes, stored.modeled_state_bytes
    text = (
        f"optimizer state measured in the checkpoint: {measured:,} B ({what}) for "
        f"{state.optimizer_params} parameters; the memory model counts {modeled:,} B "
        f"unsharded for --optimizer {cfg.optimizer}"
    )
    if measured != modeled:
        text += "; they differ"
        if state.without_state:
            more = len(state.without_state) - 3
            names = ", ".join(state.without_state[:3]) + (f" and {more} more" if more > 0 else "")
            text += f": the checkpoint has no state for {names} (tied, frozen or buffers?)"
        text += "; check --optimizer, --master-weights and --model (per-rank figures: the model's)"
    notes.append(text)
    return tuple(notes)
