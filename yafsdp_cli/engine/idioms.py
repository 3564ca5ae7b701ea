"""Training idioms applied to a module the way training code applies them.

- ``apply_checkpointing(module, mode, units)``: activation checkpointing of every
  unit (repeated block). A Hugging Face model gets its own
  ``activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": ...})``
  (v4: ``gradient_checkpointing_enable``), what ``TrainingArguments`` and training
  scripts call; any other module gets
  ``torch.utils.checkpoint.checkpoint`` around each unit's forward, as torchtitan's
  per-block wrapper does. ``mode`` is ``none``, ``reentrant`` or ``non-reentrant``.
- ``compiled(module)``: ``torch.compile`` with the default (inductor) backend.

Apply them to each model separately (after any ``copy.deepcopy``): a wrapped forward
is a closure over its own module, and a copy of it would still call the original.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import YafsdpError
from .choices import CHECKPOINTING, check_checkpointing  # noqa: F401 - idioms' API


def apply_checkpointing(module: nn.Module, mode: str, units: Sequence[str]) -> str:
    """Checkpoint every unit of ``module``; returns what was done, in words."""
    check_checkpointing(mode)
    if mode == "none":
        return ""
    reentrant = mode == "reentrant"
    if getattr(module, "supports_gradient_checkpointing", False):
        kwargs = {"use_reentrant": reentrant}
        enable = getattr(module, "activation_checkpointing_enable", None)  # transformers v5
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
            return f"transformers' activation_checkpointing_enable(use_reentrant={reentrant})"
        if hasattr(module, "gradient_checkpointing_enable"):  # v4
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return f"transformers' gradient_checkpointing_enable(use_reentrant={reentrant})"
    blocks = [u for u in units if u]
    if not blocks:
        raise YafsdpError(
            f"--checkpointing {mode}: this model has no repeated blocks to checkpoint; "
            "name them with --unit"
        )
    for name in blocks:
        _wrap(module.get_submodule(name), reentrant)
    return f"torch.utils.checkpoint ({mode}) around each of {len(blocks)} units"


def _wrap(block: nn.Module, reentrant: bool) -> None:
    inner = block.forward

    def forward(*args, **kwargs):
        if reentrant:  # reentrant checkpointing takes tensors positionally only
            args = _an_input_requiring_grad(args)
            return checkpoint(lambda *a: inner(*a, **kwargs), *args, use_reentrant=True)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def _an_input_requiring_grad(args: tuple) -> tuple:
    """Reentrant checkpointing backpropagates only from inputs that require grad; a
    first block fed the data itself would get none, so the first floating-point input
    is made to require it (what transformers' ``enable_input_require_grads`` does)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled() or any(t.requires_grad for t in tensors):
        return args
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return (*args[:i], a.detach().requires_grad_(), *args[i + 1 :])
    return args


def compiled(module: nn.Module):
    """``torch.compile(module)``: what ``--compile`` runs."""
    return torch.compile(module)
