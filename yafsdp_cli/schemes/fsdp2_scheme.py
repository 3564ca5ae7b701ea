"""``fsdp2``: PyTorch FSDP2, ``fully_shard`` on every unit and the root.

Memory: FSDP2's fullest rank (``memory.fsdp2``): float32 shards and the training
dtype gathered under master weights (``MixedPrecisionPolicy(param_dtype=...)``), one
reduce-scatter input in the gradient dtype (``reduce_dtype``). With
``reshard_after_forward=True`` (the default) the root stays gathered and two other
units are in flight, and at each phase it holds what the reference step holds (its
bytes where the flat model's buffers stood); with ``False`` every unit stays
gathered from its forward to its backward, so the whole model is gathered at the
start of backward: the shards and every gathered unit in forward (no gradient
exists: ``zero_grad(set_to_none=True)``), plus one reduce-scatter input in
backward; after backward every unit is resharded and the sharded gradients remain.

Gradient accumulation: with gradient sync on (the default) every micro-batch
reduce-scatters and the sharded gradients accumulate, which is what the reference
step (the flat runtime) does, so the rows hold what it holds. With
``set_requires_gradient_sync(False)`` until the last micro-batch, each parameter's
gradient stays unsharded (in the reduce dtype) from the first backward to the last
micro-batch's reduce-scatter, which makes the sharded ones: the forward and backward
hold every gradient whole in place of the shards; the optimizer step as with sync
on (``unsynced``).

Collectives: one all-gather per unit of its parameters padded to ``torch.chunk``'s
largest chunk times the world size, in the training dtype, in forward and again in
backward for every unit but the root; one reduce-scatter per unit in the gradient
dtype.

``plan --scheme`` runs FSDP2 itself in the fake step (``planning.engine_rows``); the
model here is what ``inspect`` reports, and the holdings its rows break their peaks
into.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import SHARDED, Collectives, Holds, Scheme, at_reference, renamed


@dataclass(frozen=True)
class Fsdp2(Scheme):
    def memory(self, parts):
        fsdp = renamed(parts.report.fsdp2.fullest, self)
        if parts.settings.reshard_after_forward or parts.world_size == 1:
            return fsdp
        return renamed(fsdp, self, gather=parts.every_unit_gathered())

    def sharded_peak(self, phase, m, step, world_size, settings) -> int:
        if settings.reshard_after_forward:
            return at_reference(m, step)
        held = m.total - m.grads - m.reduce  # shards and every unit gathered, no gradient
        if phase == "backward":
            held += m.reduce
        elif phase == "optimizer":
            held += m.grads - m.gather
        return held + step.own

    def configuration(self, settings) -> str:
        return f"reshard_after_forward={settings.reshard_after_forward}"

    def unsynced(self, phase, m, whole_grads) -> int:
        return 0 if phase == "optimizer" else whole_grads - m.grads


FSDP2 = Fsdp2(
    name="fsdp2",
    label="FSDP2",
    holds=Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED),
    collectives=Collectives(gathers_params=True, reduces="reduce_scatter", sized_by="placement"),
    inspect_key="fsdp",
    timing_key="fsdp2",
    engine="torch.distributed.fsdp.fully_shard",
)
