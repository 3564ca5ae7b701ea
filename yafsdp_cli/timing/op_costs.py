"""What each aten op of a step costs: matrix FLOPs, vector FLOPs, bytes, kernels.

``OpCounter`` is a ``TorchDispatchMode`` that sees every op a fake step runs, with
shapes and dtypes (no values are needed). Per op it records:

- matrix FLOPs, from ``torch.utils.flop_counter.flop_registry`` (the formulas
  ``FlopCounterMode`` uses: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions,
  ``_scaled_mm``, the sdpa kernels and their backwards; ``F.linear`` reaches
  dispatch as ``t`` + ``mm``/``addmm``), in the dtype of the op's first input;
- what we add to torch's counts, for the kernel that runs, not the maths it stands
  for (``kernel_flops``): a causal attention (``is_causal`` with as many queries as
  keys) skips the masked half of its score blocks, so flash, mem-efficient and cuDNN
  attention with ``is_causal`` count half of torch's figure, forward and backward.
  torch's backward formula already counts the recomputation of the scores that
  flash (and the others) do in backward: 5 products of the forward's 2 shapes, so
  the backward kernel is 2.5x the forward;
- model FLOPs (``model_flops``, the useful work MFU is taken over): torch's forward
  figure for attention without the causal half, its backward as 2x the forward
  (no recomputed scores), every other matrix op as torch counts it; the forward a
  checkpointed unit recomputes in backward is marked ``recompute`` and is not model
  work (it runs with grad mode on inside backward, which a plain backward op never
  does);
- vector FLOPs: one per element of the larger side (inputs or outputs) of every
  other op that runs a kernel: pointwise ops, reductions, copies, casts;
- bytes: every tensor input read once, plus every output the op makes and every
  argument it writes in place (``add_``, ``_foreach_mul_``, the fused optimizer),
  as its schema says. An embedding reads the rows it looks up, not the whole table;
- kernels: one per op that launches one; views, ``empty`` and metadata ops launch
  none. A foreach or fused op is one launch here (CUDA's ``multi_tensor_apply``
  launches one per chunk of tens of tensors: a few more for a large model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..profiling.tracker import op_tensors

aten = torch.ops.aten

# attention kernels (forward, backward) whose FLOPs torch's registry counts
ATTENTION_FORWARD = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward,
    aten._efficient_attention_forward,
}
ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_backward,
    aten._efficient_attention_backward,
}
# the kernels that take (batch, sequence, heads, head dim), not the sdpa ops' (b, h, s, d)
BSHD_ATTENTION = {
    aten._flash_attention_forward,
    aten._efficient_attention_forward,
    aten._flash_attention_backward,
    aten._efficient_attention_backward,
}
# torch's backward formula is 5 products of the forward's shapes: the scores again,
# then the gradients of the scores, of q, of k and of v (4, the model's own work)
BACKWARD_PRODUCTS, MODEL_BACKWARD_PRODUCTS = 5, 4
FUSED_ADAM = {aten._fused_adam_, aten._fused_adamw_}
# ops that launch no kernel: they make views, allocate, or read metadata
NO_KERNEL = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten._unsafe_view,
    aten.detach,
    aten.alias,
    aten.lift_fresh,
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.sym_storage_offset,
    aten.is_same_size,
    aten._local_scalar_dense,
}


@dataclass(frozen=True, slots=True)
class OpCost:
    """One kernel of a step: what it computes and moves."""

    name: str  # "aten.mm.default"
    phase: str  # forward | backward | optimizer; later_forward | later_backward | accumulate
    dtype: str  # of the first tensor input: the matrix FLOPs' precision
    matrix_flops: int  # what the kernel computes (causal attention: half)
    model_flops: int  # useful matrix work (no recompute, full attention)
    vector_flops: int
    bytes: int
    recompute: bool  # forward recomputed by activation checkpointing, in backward
    # the shape the roofline's efficiency reads: a matrix product's (M, K, N), an
    # attention kernel's (sequence, head dimension, causal 0|1); () for other ops
    dims: tuple[int, ...] = ()


class OpCounter(TorchDispatchMode):
    """Records an ``OpCost`` per kernel-launching op in ``costs`` while ``phase``, which
    the caller sets as the step goes, is not None."""

    def __init__(self):
        super().__init__()
        self.phase: str | None = None  # None: not counting (a warm-up step)
        self.costs: list[OpCost] = []
        # gradients held between micro-batches (by ``id``): an in-place add into one
        # of them is counted as ``held_phase`` (gradient accumulation's own kernels)
        self.held: frozenset[int] = frozenset()
        self.held_phase: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.phase is not None and launches_kernel(func):
            recompute = self.phase.endswith("backward") and torch.is_grad_enabled()
            phase = self.phase
            if func is aten.add_.Tensor and self.held and id(args[0]) in self.held:
                phase = self.held_phase or phase
            self.costs.append(op_cost(func, args, kwargs, out, phase, recompute))
        return out


def launches_kernel(func) -> bool:
    """False for views (a return that aliases an input without writing it), empty
    allocations and metadata ops (``prim.device``, ``sym_size``: no tensor made or
    written)."""
    if func.overloadpacket in NO_KERNEL:
        return False
    schema = func._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return False
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return writes or any("Tensor" in str(r.type) for r in schema.returns)


def op_cost(func, args, kwargs, out, phase: str, recompute: bool) -> OpCost:
    ins = op_tensors(args, kwargs.values())
    packet = func.overloadpacket
    matrix = model = 0
    if packet in flop_registry:
        torch_flops = flop_registry[packet](*args, **kwargs, out_val=out)
        matrix, model = kernel_flops(func, args, kwargs, torch_flops)
    read, written, elems = _traffic(func, args, kwargs, out, ins)
    return OpCost(
        name=str(func),
        phase=phase,
        dtype=str(ins[0].dtype).removeprefix("torch.") if ins else "",
        matrix_flops=matrix,
        model_flops=0 if recompute else model,
        vector_flops=0 if packet in flop_registry else elems,
        bytes=read + written,
        recompute=recompute,
        dims=_dims(packet, args, kwargs, func) if packet in flop_registry else (),
    )


def _dims(packet, args, kwargs, func) -> tuple[int, ...]:
    """(M, K, N) of a 2-D or batched product; (sequence, head dim, causal) of an
    attention kernel; () where neither reads off the arguments."""
    if packet in ATTENTION_FORWARD or packet in ATTENTION_BACKWARD:
        named = _named_args(func, args, kwargs)
        q = named.get("query")
        if q is None or q.dim() < 2:
            return ()
        causal = bool(named.get("is_causal", False)) and _square(named)
        seq = q.shape[1] if packet in BSHD_ATTENTION else q.shape[-2]
        return (seq, q.shape[-1], int(causal))
    if packet in (aten.mm, aten.bmm) and len(args) >= 2:
        a, b = args[0], args[1]
    elif packet in (aten.addmm, aten.baddbmm) and len(args) >= 3:
        a, b = args[1], args[2]
    else:
        return ()
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2:
        return ()
    return (a.shape[-2], a.shape[-1], b.shape[-1])


def kernel_flops(func, args, kwargs, torch_flops: int) -> tuple[int, int]:
    """(what the kernel computes, the useful matrix work) from torch's count."""
    packet = func.overloadpacket
    if packet not in ATTENTION_FORWARD and packet not in ATTENTION_BACKWARD:
        return torch_flops, torch_flops
    named = _named_args(func, args, kwargs)
    causal = bool(named.get("is_causal", False)) and _square(named)
    kernel = torch_flops // 2 if causal else torch_flops
    if packet in ATTENTION_BACKWARD:
        return kernel, torch_flops * MODEL_BACKWARD_PRODUCTS // BACKWARD_PRODUCTS
    return kernel, torch_flops


def _named_args(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _square(named: dict) -> bool:
    q, k = named.get("query"), named.get("key")
    return q is None or k is None or q.shape[-2] == k.shape[-2]


def _traffic(func, args, kwargs, out, ins) -> tuple[int, int, int]:
    """(bytes read, bytes written, elements of the larger side)."""
    written_args = _written(func, args, kwargs)
    outs = _fresh_outputs(func, out)
    if func.overloadpacket is aten.embedding:
        indices = args[1]  # args[0] is the table: only the looked-up rows are read
        rows = sum(_nbytes(t) for t in outs)  # the rows looked up, as the output holds them
        read = rows + _nbytes(indices)
        return read, rows, sum(t.numel() for t in outs)
    read = sum(_nbytes(t) for t in ins)
    written = sum(_nbytes(t) for t in written_args + outs)
    elems = max(sum(t.numel() for t in ins), sum(t.numel() for t in written_args + outs))
    return read, written, elems


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The arguments the op writes, as its schema marks them; the fused Adam kernels'
    schema marks the gradients written, which they are only when unscaled by a
    ``grad_scale`` (mixed-precision float16 training)."""
    named = _named_args(func, args, kwargs)
    unscaled = func.overloadpacket in FUSED_ADAM and named.get("grad_scale") is None
    found = []
    for arg in func._schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write:
            if unscaled and arg.name == "grads":
                continue
            found += op_tensors([named.get(arg.name)])
    return found


def _fresh_outputs(func, out) -> list[torch.Tensor]:
    """The outputs the op allocates (not those that alias an argument)."""
    outs = out if isinstance(out, (list, tuple)) else (out,)
    returns = func._schema.returns
    fresh = []
    for i, value in enumerate(outs):
        alias = returns[i].alias_info if i < len(returns) else None
        if alias is None:
            fresh += op_tensors([value])
    return fresh


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def total(costs, field: str) -> int:
    return sum(getattr(c, field) for c in costs)
