"""Training idioms applied to a module the way training code applies them.

- ``apply_checkpointing(module, mode, units)``: activation checkpointing of the
  units (repeated blocks). A Hugging Face model gets its own
  ``activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": ...})``
  (v4: ``gradient_checkpointing_enable``), what ``TrainingArguments`` and training
  scripts call; any other module gets ``torch.utils.checkpoint.checkpoint`` around
  each unit's forward, as torchtitan's per-block wrapper does. ``mode`` is ``none``,
  ``reentrant``, ``non-reentrant`` or one of torchtitan's selective modes
  (``choices.Checkpointing``):

  - ``selective:op``: every block non-reentrant, with ``context_fn`` the selective
    policy of ``selective.py`` (transformers passes its kwargs on to
    ``torch.utils.checkpoint.checkpoint``, so its own path takes it too);
  - ``selective:layer=N``: the N-th, 2N-th, ... block fully checkpointed
    (non-reentrant), the others not. transformers' ``every_n_layers`` counts from 0
    (layers 0, N, 2N, ...), torchtitan from 1; torchtitan's rule is kept, so on a
    transformers model its layers are enabled, then the flag of every layer the rule
    leaves out is turned off again, in the order transformers counts them.
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
from .choices import CHECKPOINTING, Checkpointing, nth, parse_checkpointing  # noqa: F401 - API
from .selective import selective_contexts


def apply_checkpointing(module: nn.Module, mode: str, units: Sequence[str]) -> str:
    """Checkpoint the units of ``module`` as ``mode`` says; returns what was done, in
    words."""
    ck = parse_checkpointing(mode)
    if not ck.enabled:
        return ""
    if getattr(module, "supports_gradient_checkpointing", False):
        # every N-th layer needs layers transformers can turn off one by one
        hf_layers = _hf_layers(module) if ck.every > 1 else []
        done = _hf_enable(module, ck) if ck.every == 1 or hf_layers else None
        if done is not None:
            return done + (_hf_every(hf_layers, ck.every) if hf_layers else "")
    blocks = [u for u in units if u]
    if not blocks:
        raise YafsdpError(
            f"--checkpointing {mode}: this model has no repeated blocks to checkpoint; "
            "name them with --unit"
        )
    chosen = [b for k, b in enumerate(blocks, 1) if k % ck.every == 0]
    for name in chosen:
        _wrap(module.get_submodule(name), ck)
    if ck.every == 1:
        return f"torch.utils.checkpoint ({mode}) around each of {len(blocks)} units"
    return (
        f"torch.utils.checkpoint ({mode}, non-reentrant) around {len(chosen)} of "
        f"{len(blocks)} units: every {nth(ck.every)}, counted from 1"
    )


def _checkpoint_kwargs(ck: Checkpointing) -> dict:
    """What ``torch.utils.checkpoint.checkpoint`` takes for ``ck``."""
    if ck.selective_op:
        return {"use_reentrant": False, "context_fn": selective_contexts}
    return {"use_reentrant": ck.reentrant}


def _hf_enable(module: nn.Module, ck: Checkpointing) -> str | None:
    """transformers' own enable with ``ck``'s kwargs; None where the model has none."""
    kwargs = _checkpoint_kwargs(ck)
    words = f"use_reentrant={ck.reentrant}" + (
        ", context_fn=the selective:op policy" if ck.selective_op else ""
    )
    enable = getattr(module, "activation_checkpointing_enable", None)  # transformers v5
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
        return f"transformers' activation_checkpointing_enable({words})"
    if hasattr(module, "gradient_checkpointing_enable"):  # v4
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return f"transformers' gradient_checkpointing_enable({words})"
    return None


def _hf_layers(module: nn.Module) -> list[nn.Module]:
    """transformers' checkpointed layers (``GradientCheckpointingLayer``), in the order
    its enable counts them (``modules()``); none on a model without them. Matched by
    class name so that this module never imports transformers."""
    return [
        m
        for m in module.modules()
        if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__[1:])
    ]


def _hf_every(layers: list[nn.Module], every: int) -> str:
    """Leave checkpointed only every ``every``-th of ``layers``, counted from 1."""
    for k, layer in enumerate(layers, 1):
        layer.gradient_checkpointing = k % every == 0
    kept = sum(1 for k in range(1, len(layers) + 1) if k % every == 0)
    return (
        f", then {kept} of its {len(layers)} layers left checkpointed: every {nth(every)}, "
        "counted from 1"
    )


def _wrap(block: nn.Module, ck: Checkpointing) -> None:
    inner = block.forward
    kwargs_ck = _checkpoint_kwargs(ck)

    def forward(*args, **kwargs):
        if ck.reentrant:  # reentrant checkpointing takes tensors positionally only
            args = _an_input_requiring_grad(args)
            return checkpoint(lambda *a: inner(*a, **kwargs), *args, use_reentrant=True)
        return checkpoint(inner, *args, **kwargs_ck, **kwargs)

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
