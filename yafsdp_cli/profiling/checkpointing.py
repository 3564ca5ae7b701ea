"""``--checkpointing units``: activation checkpointing as training code applies it.

- a transformers model: its own ``activation_checkpointing_enable`` (v5; v4:
  ``gradient_checkpointing_enable``) with ``use_reentrant=False``, what
  ``TrainingArguments(gradient_checkpointing=True)`` does: every decoder layer's
  ``__call__`` runs under ``torch.utils.checkpoint``;
- any other model: each unit (``--unit``, default the repeated blocks) runs under
  non-reentrant ``torch.utils.checkpoint``, as torchtitan's per-block wrapper does.
  The module's ``forward`` is wrapped in place rather than the module wrapped in a
  child, so parameter names (and so the flat layout) do not change; the module's own
  hooks run outside the checkpointed region.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import YafsdpError


def apply_checkpointing(module: nn.Module, units: Sequence[str], mode: str) -> str:
    """Checkpoint ``module`` per ``mode`` (``none`` | ``units``); a note saying how."""
    if mode == "none":
        return ""
    if getattr(module, "supports_gradient_checkpointing", False):
        return _transformers(module)
    wanted = [u for u in units if u]
    if not wanted:
        raise YafsdpError(
            f"--checkpointing units: {type(module).__name__} has no units to checkpoint "
            "(no repeated blocks were found); name them with --unit GLOB"
        )
    named = dict(module.named_modules())
    for name in wanted:
        _wrap_forward(named[name])
    return (
        f"activation checkpointing: non-reentrant torch.utils.checkpoint around each of "
        f"{len(wanted)} units' forward"
    )


def _transformers(module: nn.Module) -> str:
    kwargs = {"use_reentrant": False}
    enable = getattr(module, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        how = "activation_checkpointing_enable"
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        how = "gradient_checkpointing_enable"
    return f"activation checkpointing: transformers' {how}(use_reentrant=False), every layer"


def _wrap_forward(unit: nn.Module) -> None:
    inner = unit.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    unit.forward = forward
