"""Kernels the fake step substitutes, so it allocates what the real kernels allocate.

``OVERRIDES`` (used by ``fake.FakeStep`` for ops with fake arguments):

- ``aten._grouped_mm`` (transformers 5's fused MoE experts): torch's meta kernel
  takes only bfloat16 (the CUDA kernel's rule) and returns a packed output, while the
  CPU and CUDA kernels take float32 too and pad the output's row stride to 16 bytes.
  Ours makes the kernels' output (shape and strides as their output helper makes
  it), so autograd saves and frees the same bytes as in a real step.

``CudaAttention`` (``--target cuda`` on a machine without a GPU) is a
``TorchFunctionMode`` that routes ``F.scaled_dot_product_attention`` to the kernel
PyTorch's CUDA dispatcher would pick, called on the fake tensors through PyTorch's
own meta kernels and autograd formulas (so what is saved for backward is what the
CUDA op saves). The choice follows ``sdp_utils.cpp`` for sm80 and later (A100, H100)
with default settings:

- flash: no ``attn_mask``; float16 or bfloat16; q, k, v head dims equal and at most
  256 (padded to a multiple of 8 first, as ``attention.cpp`` does); ``is_causal``
  only with as many queries as keys. Saves the output, a (batch, heads, seq) float32
  log-sum-exp and the philox state (a 2-element and a 0-d uint64 tensor);
- mem-efficient: float32, float16 or bfloat16; head dims divisible by 4 (float32) or
  8; a boolean mask becomes an additive one in the query's dtype, padded to a
  multiple of 8 keys where its strides are not aligned (``preprocess_mask``). Saves
  the output, a (batch, heads, seq rounded up to 32) float32 log-sum-exp and a 0-d
  seed and offset. Grouped key/value heads are
  expanded to the query's heads first (assumed; not checked on a GPU here);
- otherwise the math path, which is the same composite on CUDA as on the CPU.

Newer cuDNN builds on H100/B200 put cuDNN attention first; it saves the output and
(batch, heads, seq) float32 statistics, the bytes flash saves. Kernel workspaces
(flash backward's float32 dq accumulator, cuBLAS workspaces) are allocated inside
the kernels, where no dispatch mode sees them, on either target.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """What ``torch._grouped_mm``'s CPU and CUDA kernels return (2-D/3-D operands)."""
    if mat_a.shape[-1] != mat_b.shape[-2] and not (mat_a.dim() == 2 and mat_b.dim() == 2):
        raise RuntimeError(
            f"_grouped_mm: contraction dimensions differ: {tuple(mat_a.shape)} @ "
            f"{tuple(mat_b.shape)}"
        )
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]  # (G, M, N) from (K, M)^T (K, N)
    elif mat_a.dim() == 2:
        size = [mat_a.shape[0], mat_b.shape[-1]]  # (M, N): rows grouped by offs
    elif mat_b.dim() == 2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]  # batched
    dtype = out_dtype or mat_a.dtype
    align = max(1, 16 // dtype.itemsize)  # rows start on 16-byte boundaries
    row = -(-size[-1] // align) * align
    stride = [size[1] * row, row, 1] if len(size) == 3 else [row, 1]
    out = torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)
    if bias is not None:
        out.add_(bias)
    return out


OVERRIDES = {}
if hasattr(aten, "_grouped_mm"):
    OVERRIDES[aten._grouped_mm.default] = grouped_mm


class CudaAttention(TorchFunctionMode):
    """See the module docstring; ``used`` counts the kernels chosen."""

    def __init__(self):
        super().__init__()
        self.used: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(
        self,
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        kernel = cuda_kernel(q, k, v, attn_mask, is_causal)
        self.used[kernel] += 1
        mask = _float_mask(attn_mask, q.dtype)
        if kernel == "flash":
            return _flash(q, k, v, dropout_p, is_causal, scale)
        if kernel == "efficient":
            if enable_gqa and k.shape[-3] != q.shape[-3]:
                rep = q.shape[-3] // k.shape[-3]
                k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
            mask = None if mask is None else _pad_mask(mask, q, k)
            lse = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
            out = aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, lse, dropout_p, is_causal, scale=scale
            )
            return out[0]
        return aten._scaled_dot_product_attention_math(
            q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


def cuda_kernel(q, k, v, attn_mask, is_causal: bool) -> str:
    """``flash``, ``efficient`` or ``math``: what sm80+ CUDA would run (see the docstring)."""
    dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    half = q.dtype in (torch.float16, torch.bfloat16)
    square = not is_causal or q.shape[-2] == k.shape[-2]
    if attn_mask is None and half and len(set(dims)) == 1 and dims[0] <= 256 and square:
        return "flash"
    align = 8 if half else 4
    if (
        q.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q.shape[-1] == k.shape[-1]
        and q.shape[-1] % align == 0
        and v.shape[-1] % align == 0
    ):
        return "efficient"
    return "math"


def _flash(q, k, v, dropout_p, is_causal, scale):
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if d % 8:
        q, k, v = (F.pad(t, (0, 8 - d % 8)) for t in (q, k, v))
    out = aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale
    )[0]
    return out[..., :d] if d % 8 else out


def _float_mask(mask, dtype):
    """``convert_boolean_attn_mask``: a boolean mask as the additive float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    ninf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, 0.0, ninf)


def _pad_mask(mask, q, k):
    """``preprocess_mask``: a mask whose strides are not 8-aligned is copied with its
    last dim padded to a multiple of 8 (then sliced back), and expanded to (B, H, Sq, Sk)."""
    aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
    if not aligned:
        sk = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - sk % 8))[..., :sk]
    return mask.expand(q.shape[0], q.shape[-3], q.shape[-2], k.shape[-2])
