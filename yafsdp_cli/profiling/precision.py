"""Mixed precision as people train it, for ``profile --param-dtype``.

The floating-point parameters are cast to the training dtype (``cast_params``);
each trainable 16-bit parameter (a flat buffer or shard, once converted) gets a
float32 master copy, and the optimizer steps on the masters, so its states are
float32 too (what ``MemoryConfig``'s auto master weights count). ``Masters`` runs
the hand-over around the optimizer step:

- after each backward, with ``--grad-dtype float32``, each 16-bit gradient becomes
  the master's float32 gradient at once (added to it after the first micro-batch of
  an accumulated step) and the 16-bit one is freed: the step holds float32
  gradients, as with float32 gradient reduction (the collectives of the sharded
  runtime still run in the parameter dtype);
- otherwise the gradients stay 16-bit until the optimizer step, which reads float32
  copies of them (a temporary of the optimizer phase);
- after the step the masters are copied back into the 16-bit parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine import dtypes
from ..options import check_training_dtypes  # noqa: F401 - precision's API


def cast_params(module: nn.Module, param_dtype: str | None, keep_frozen: bool = False) -> None:
    """Every floating-point parameter and buffer in ``param_dtype``, as
    ``module.to(dtype)`` does (BatchNorm needs its statistics in the input's dtype),
    but a module's tensors of a fixed format (``keep_format``: a quantized layer's
    float32 scales, which bitsandbytes keeps so whatever the compute dtype).
    ``keep_frozen``: parameters that do not train keep their stored dtype, as a LoRA
    base does (peft's layers cast what they are given to the adapter's dtype; a
    frozen layer without one would meet the other dtype and fail)."""
    if not param_dtype:
        return
    target = dtypes.to_torch(dtypes.canonical(param_dtype))
    for p in module.parameters():  # one per tensor: tied owners share the cast
        if (p.requires_grad or not keep_frozen) and p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != target:
                mod._buffers[name] = b.to(target)
        keep = getattr(mod, "keep_format", None)  # a quantized base's scales stay float32
        if keep is not None:
            keep()


class Masters:
    """float32 masters of the 16-bit trainable ``params``; ``stepped`` is what the
    optimizer steps on (masters, then the parameters that are float32 already)."""

    def __init__(self, module: nn.Module, params, grad_dtype: str | None):
        low = [p for p in params if p.requires_grad and _is_16bit(p)]
        self.pairs = [(p, nn.Parameter(p.detach().to(torch.float32))) for p in low]
        ids = {id(p) for p in low}
        self.stepped = [m for _, m in self.pairs] + [p for p in params if id(p) not in ids]
        self.module = module
        self.early = grad_dtype is not None and dtypes.canonical(grad_dtype) == "float32"

    def masters(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def after_backward(self) -> None:
        if self.early:
            self._hand_over()

    def before_step(self) -> None:
        self._hand_over()

    def after_step(self) -> None:
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)
                m.grad = None

    def grads(self) -> list[torch.Tensor]:
        return [m.grad for _, m in self.pairs if m.grad is not None]

    def _hand_over(self) -> None:
        for p, m in self.pairs:
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.to(torch.float32)
            else:  # a later micro-batch's: accumulated in float32
                m.grad.add_(p.grad)
        stepped = {id(p) for p in self.stepped}
        for q in [*(p for p, _ in self.pairs), *self.module.parameters()]:
            if id(q) not in stepped:
                q.grad = None  # the 16-bit gradient and its per-entry views


def _is_16bit(p: torch.Tensor) -> bool:
    return p.is_floating_point() and p.element_size() <= 2
