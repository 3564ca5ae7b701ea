"""torchtitan's op-level selective activation checkpointing (``selective:op``).

A checkpointed block runs its forward under ``torch.utils.checkpoint`` (non-reentrant)
with ``context_fn=selective_contexts``: ``create_selective_checkpoint_contexts`` with
``op_policy()``, a fresh policy per block call. The policy is torchtitan's (v0.2.2,
``torchtitan/distributed/activation_checkpoint.py`` ``_apply_op_sac`` with the save
list of ``torchtitan/models/llama3/infra/parallelize.py``, the last release that has
both ``selective_ac_option`` forms), written out here:

- the output of an op on ``SAVE_LIST`` is saved (``MUST_SAVE``), except that every
  second ``aten.mm`` of the block's forward (the 2nd, 4th, ...) is recomputed;
- a copy from a CUDA tensor to the CPU (``aten._to_copy`` with ``device=cpu``) is
  saved, so a host sync in a block is not run twice;
- everything else is recomputed (``PREFER_RECOMPUTE``).

torchtitan also recomputes any mm whose weight has the shape of a linear named by
``per_op_sac_force_recompute_mm_shapes_by_fqns`` (default ``moe.router.gate``, its own
MoE router's name); the models profiled here have no module of that name, so that
rule picks nothing and is left out.

The policy sees ops as the dispatcher runs them, below autograd: ``F.linear`` on a
3-D input reaches it as ``aten.mm``, sdpa as the fused kernel the backend chose
(CUDA: ``_scaled_dot_product_flash_attention`` or ``..._efficient_attention``; the
CPU's is ``_scaled_dot_product_flash_attention_for_cpu``, which is not on the list,
so on the CPU attention is recomputed as torchtitan's policy recomputes it there).
A composite (the math path's ``_scaled_dot_product_attention_math``) decomposes
before it reaches a dispatch mode in eager mode: its pieces are recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten


def _resolved(root, path: str):
    """The op at ``path`` under ``root``, or None where this torch has no such op."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# torchtitan's ``_op_sac_save_list``; the last four exist only with their libraries
# (flex attention and inductor's compiled regions never run in an eager step here).
SAVE_LIST = frozenset(
    op
    for op in (
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        _resolved(torch.ops, "_c10d_functional.reduce_scatter_tensor.default"),
        aten.max.default,  # the absolute maximum of low-precision training's scaling
        _resolved(torch, "_higher_order_ops.flex_attention"),
        _resolved(torch.ops, "torch_attn._varlen_attn.default"),
        _resolved(torch, "_higher_order_ops.inductor_compiled_code"),
    )
    if op is not None
)


def op_policy() -> Callable[..., CheckpointPolicy]:
    """One block call's policy (see the module docstring). Torch versions that ask
    the policy again while recomputing (``ctx.is_recompute``) get their own mm count
    there, so the recompute takes the forward's decisions."""
    mm_count = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func == aten._to_copy.default and _to_host(args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        if func == aten.mm.default:
            mm_count[ctx.is_recompute] += 1
            if mm_count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in SAVE_LIST:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _to_host(args, kwargs) -> bool:
    src = args[0] if args else None
    device = kwargs.get("device")
    return (
        isinstance(src, torch.Tensor)
        and src.device.type == "cuda"
        and device is not None
        and torch.device(device).type == "cpu"
    )


def selective_contexts():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: called once per
    checkpointed call, so each block's forward counts its own mms."""
    return create_selective_checkpoint_contexts(op_policy())
