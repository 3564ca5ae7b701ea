"""``zero1`` / ``zero2`` / ``zero3``: DeepSpeed ZeRO with its defaults.

(``DeepSpeedZeroConfig`` of deepspeed 0.19, ``memory.step_schemes.ZeroConfig``:
``reduce_bucket_size`` 5e8 and ``allgather_bucket_size`` 5e8 elements,
``contiguous_gradients`` on, ``overlap_comm`` on for stage 3 only,
``stage3_prefetch_bucket_size`` 5e7, ``stage3_param_persistence_threshold`` 1e5,
``stage3_max_live_parameters`` 1e9, ``stage3_max_reuse_distance`` 1e9.)

Memory: optimizer states and float32 masters are partitioned in every stage. ZeRO-1
keeps whole parameters and gradients; ZeRO-2 whole parameters and a
``1/world_size`` gradient partition; ZeRO-3 partitions parameters too, except those
of at most ``param_persistence_threshold`` elements, which every rank keeps whole.
With contiguous gradients every stage copies gradients into an "ipg" bucket of
``reduce_bucket_size`` elements in the gradient dtype, allocated whole (not capped by
the model's size) and kept. ZeRO-3 gathers the unit that computes and prefetches up
to ``prefetch_bucket_size`` elements of the next; a parameter the step reuses within
``max_reuse_distance`` elements is not released, so at the turn from forward to
backward the last ``max_reuse_distance`` elements stay gathered (a whole model
smaller than that); never more than ``max_live_parameters`` at once
(``memory.step_schemes.SchemeParts.zero3``).

At each phase, above world size 1:

- ``zero1`` / ``zero2``: whole parameters and the partitioned optimizer states and
  masters throughout, and no gradient or bucket in forward: DeepSpeed allocates its
  buckets when the first gradient lands and frees them, with the partition's
  gradient buffer, once the step is over. Stage 2 reduces in the gradient hooks:
  each gradient is copied into the bucket and freed, those of the rank's partition
  into a ``1/world_size`` buffer. Stage 1 (``overlap_comm`` off) reduces after
  backward, so its gradients land whole first, as in the reference. So the backward
  holds the bucket and partition buffer only where the reference's backward peak
  has gradients already. The optimizer phase converts the partition's gradients to
  float32 and steps them: the reference step's gradients and optimizer temporaries,
  ``1/world_size`` of them.
- ``zero3``: its partitions, the whole persistent parameters, the partition's
  gradient buffer and the bucket throughout (all allocated once, at the engine's
  start), the gathered parameters in forward and backward, released after backward.

Collectives: not modelled by the step-time model (``collectives`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import SHARDED, WHOLE, Holds, Scheme, renamed, short_count

# DeepSpeed's engine needs CUDA (its accelerator and ops), which the fake step on the
# CPU has not; on CPU it runs only with DS_ACCELERATOR=cpu and a C++ build, which
# ``tests/planning/test_plan_zero_truth.py`` uses where DeepSpeed is installed
NOT_RUN = "DeepSpeed's engine needs CUDA"


def _bucket(settings) -> str:
    return f"reduce_bucket_size={short_count(settings.zero.reduce_bucket_size)}"


@dataclass(frozen=True)
class Zero12(Scheme):
    """Stages 1 and 2: whole parameters; stage 1 whole gradients too."""

    def memory(self, parts):
        ipg = 0 if parts.world_size == 1 else parts.ipg_bucket()
        out = renamed(parts.report.references[0], self, reduce=ipg)  # the zero2 reference
        if self.holds.grads == WHOLE:
            out = renamed(out, self, grads=parts.whole_grads())
        return out

    def sharded_peak(self, phase, m, step, world_size, settings) -> int:
        base = m.params + m.optimizer + m.master + m.buffers
        if phase == "forward":
            return base + step.own
        if phase == "optimizer":  # a partition's gradients made float32, and its step
            partition = (step.own - step.activations + step.grads) // world_size
            return base + step.activations + partition
        landed = step.grads > 0  # the bucket and partition buffer come with the first
        if self.holds.grads == WHOLE:  # reduced after backward: gradients land whole first
            return base + step.grads + (m.reduce if landed else 0) + step.own
        return base + ((m.reduce + m.grads) if landed else 0) + step.own

    def configuration(self, settings) -> str:
        return f"{_bucket(settings)}, contiguous_gradients"


@dataclass(frozen=True)
class Zero3(Scheme):
    def memory(self, parts):
        return parts.zero3(self)

    def sharded_peak(self, phase, m, step, world_size, settings) -> int:
        # the gathered parameters are released after backward
        return m.total - (m.gather if phase == "optimizer" else 0) + step.own

    def configuration(self, settings) -> str:
        z = settings.zero
        return (
            f"prefetch {short_count(z.prefetch_bucket_size)}, max live "
            f"{short_count(z.max_live_parameters)}, reuse distance "
            f"{short_count(z.max_reuse_distance)}, persistence "
            f"{short_count(z.param_persistence_threshold)}, {_bucket(settings)}"
        )


ZERO1 = Zero12(
    name="zero1",
    label="ZeRO-1",
    holds=Holds(params=WHOLE, grads=WHOLE, optimizer=SHARDED),
    collectives=None,
    why_modelled=NOT_RUN,
)
ZERO2 = Zero12(
    name="zero2",
    label="ZeRO-2",
    holds=Holds(params=WHOLE, grads=SHARDED, optimizer=SHARDED),
    collectives=None,
    inspect_key="zero2",
    why_modelled=NOT_RUN,
)
ZERO3 = Zero3(
    name="zero3",
    label="ZeRO-3",
    holds=Holds(params=SHARDED, grads=SHARDED, optimizer=SHARDED),
    collectives=None,
    inspect_key="zero3",
    why_modelled=NOT_RUN,
)
