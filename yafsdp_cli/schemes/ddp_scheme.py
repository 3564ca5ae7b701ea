"""``ddp``: PyTorch ``DistributedDataParallel``, everything whole on every rank.

Memory: whole parameters, gradients, optimizer states and masters, plus DDP's
gradient buckets: with ``gradient_as_bucket_view=False`` (its default) they are a
second copy of every gradient, cut into buckets of ``bucket_cap_mb=25`` (the first
1 MiB), one allocation each, made at construction and kept (``memory.step_schemes.
ddp_buckets``). They are rebuilt once, at the second forward, in the order the
gradients became ready; the old ones are freed first-come, while no gradient exists,
so the rebuild never sets the peak. At each phase it holds what the reference step
(at world size 1) holds, its buckets beside.

Gradient accumulation: ``no_sync()`` until the last micro-batch; the whole gradients
accumulate in place (DDP holds them whole anyway, and the reference step at world
size 1 holds them from its first backward on), and the last micro-batch all-reduces
them through the buckets (``Collectives.reduce_every_micro_batch`` False).

Collectives: one all-reduce per unit's gradients, in the gradient dtype, in
backward (DDP's buckets are about a unit's size in a large model; their count only
moves the latency term); unconverted parameters' gradients join the root's.

``plan --scheme`` runs DDP itself in the fake step (``planning.engine_rows``); the
model here is what ``inspect`` reports, and the holdings its rows break their peaks
into.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import WHOLE, Collectives, Holds, Scheme, renamed


@dataclass(frozen=True)
class Ddp(Scheme):
    def memory(self, parts):
        s = parts.settings
        buckets = 0 if parts.world_size == 1 or s.ddp_bucket_view else parts.ddp_buckets()
        return renamed(parts.report.baseline, self, reduce=buckets)

    def configuration(self, settings) -> str:
        return f"bucket_cap_mb=25, gradient_as_bucket_view={settings.ddp_bucket_view}"


DDP = Ddp(
    name="ddp",
    label="DDP",
    holds=Holds(params=WHOLE, grads=WHOLE, optimizer=WHOLE),
    collectives=Collectives(
        gathers_params=False,
        reduces="all_reduce",
        sized_by="unit_grads",
        reduce_every_micro_batch=False,  # no_sync() until the last micro-batch
    ),
    inspect_key="ddp",
    timing_key="ddp",
    engine="torch.nn.parallel.DistributedDataParallel",
)
