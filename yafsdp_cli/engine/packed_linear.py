"""A stand-in for bitsandbytes' quantized linear layers in a fake step.

bitsandbytes is not installed on every machine, and no fake kernels exist for its
ops, so ``--quantize`` puts this layer where ``Linear4bit``/``Linear8bitLt`` would
be. It holds exactly the packed tensors of the documented format
(``packed.packed_parts``): the weight as a frozen uint8/int8 parameter under the
weight's own name, the tensors beside it as buffers. Its forward does what
bitsandbytes' ``MatMul4Bit`` does with memory: the weight is dequantized to its
compute dtype, used by ``linear`` and dropped; nothing but the packed weight is saved
for backward (and, for ``int8``, the input, which ``MatMul8bitLt`` keeps), and
backward dequantizes it again to take the input's gradient. The values are not
computed, so the layer is for fake steps only: the bytes are the format's, the
kernels' workspaces (LLM.int8()'s int8 copy of the input and int32 product, the
outlier columns it keeps) are not counted.

A 4-bit weight is dequantized by ops of its own (``yafsdp::dequantize_4bit``, and
before it, for a nested format, ``yafsdp::dequantize_blockwise`` and an in-place add
of the offset), the kernels bitsandbytes' ``dequantize_4bit`` launches: the step-time
model sees each one's reads (the packed codes, the absmax scales) and writes (the
weight in its dtype) and times it as the memory-bound kernel it is, in every forward
and again in every backward. An ``int8`` weight's stand-in makes its weight without a
kernel: LLM.int8()'s forward quantizes the input and runs an int8 product instead, which
the fake step does not count.
"""

from __future__ import annotations

import torch
from torch import nn

from . import dtypes
from .packed import packed_parts


@torch.library.custom_op("yafsdp::dequantize_blockwise", mutates_args=())
def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor
) -> torch.Tensor:
    """A nested format's absmax values, uint8 ``codes`` to float32: reads the codes,
    their own float32 absmax and code table, writes one float32 per code."""
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


@dequantize_blockwise.register_fake
def _(codes, absmax, code):
    return codes.new_empty(codes.shape, dtype=torch.float32)


@torch.library.custom_op("yafsdp::dequantize_4bit", mutates_args=())
def dequantize_4bit(
    packed: torch.Tensor, absmax: torch.Tensor, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """A 4-bit weight of ``shape`` in ``dtype``: reads the packed codes (two a byte)
    and the float32 absmax of each block, writes the weight. The code table (16
    entries) is the kernel's constant."""
    return torch.empty(shape, dtype=dtype, device=packed.device)


@dequantize_4bit.register_fake
def _(packed, absmax, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def _dequantize(layer: PackedLinear, packed: torch.Tensor) -> torch.Tensor:
    """``layer``'s weight (out, in) in its dtype, made as bitsandbytes makes it."""
    if layer.kind == "int8":
        return packed.new_empty(layer.shape, dtype=layer.dtype)
    absmax = layer.weight_absmax
    if layer.kind.endswith("-dq"):
        absmax = dequantize_blockwise(
            absmax, layer.weight_nested_absmax, layer.weight_nested_quant_map
        )
        absmax.add_(layer.weight_offset)
    return dequantize_4bit(packed, absmax, list(layer.shape), layer.dtype)


class _Dequantized(torch.autograd.Function):
    """``linear(x, dequantize(packed), bias)``; backward dequantizes again. With
    ``keeps_input`` the input is kept for backward too, as LLM.int8()'s
    ``MatMul8bitLt`` keeps it (``ctx.tensors``) whether or not backward reads it."""

    @staticmethod
    def forward(ctx, x, packed, layer, bias, keeps_input):
        weight = _dequantize(layer, packed).to(x.dtype)  # (out, in), transient
        ctx.layer = layer
        # the packed weight is held by the layer anyway: no bytes of its own
        ctx.save_for_backward(packed, x) if keeps_input else ctx.save_for_backward(packed)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        packed = ctx.saved_tensors[0]
        weight = _dequantize(ctx.layer, packed).to(grad.dtype)
        return grad @ weight, None, None, None, None  # (..., out) @ (out, in)


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` of ``kind`` (``packed.KINDS``), packed; see the module
    docstring. ``dtype`` is the compute dtype the weight is dequantized to."""

    def __init__(self, linear: nn.Linear, kind: str):
        super().__init__()
        self.kind = kind
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shape = (linear.out_features, linear.in_features)
        self.dtype = linear.weight.dtype
        device = linear.weight.device
        parts = packed_parts(kind, self.shape)
        weight = parts[0]
        self.weight = nn.Parameter(
            torch.empty(weight.shape, dtype=dtypes.to_torch(weight.dtype), device=device),
            requires_grad=False,
        )
        for part in parts[1:]:
            t = torch.empty(part.shape, dtype=dtypes.to_torch(part.dtype), device=device)
            self.register_buffer("weight" + part.suffix, t)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keeps_input = self.kind == "int8"
        return _Dequantized.apply(x, self.weight, self, self.bias, keeps_input)

    def keep_format(self) -> None:
        """The tensors beside the weight back in the format's dtypes (the absmax
        scales float32), where a cast of every floating buffer to the training dtype
        changed them: bitsandbytes keeps them so whatever the compute dtype."""
        for part in packed_parts(self.kind, self.shape)[1:]:
            name = "weight" + part.suffix
            want = dtypes.to_torch(part.dtype)
            if self._buffers[name].dtype != want:
                self._buffers[name] = self._buffers[name].to(want)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def quantize_frozen_linears(module: nn.Module, kind: str, skip: set[int]) -> list[str]:
    """Every ``nn.Linear`` of ``module`` whose parameters are all frozen, except the
    modules in ``skip`` (by id: the output head, which bitsandbytes' integration keeps),
    replaced by a ``PackedLinear``; the names replaced."""
    replaced = []
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child) in skip:
                continue
            if any(p.requires_grad for p in child.parameters()):
                continue
            setattr(parent, child_name, PackedLinear(child, kind))
            replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced
