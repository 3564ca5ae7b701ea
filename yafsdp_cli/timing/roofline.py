"""The roofline: each kernel takes as long as its slowest resource, plus a floor.

For one kernel on a GPU ``g`` with efficiencies ``e``::

    t = max(matrix FLOPs / (g.matrix_peak(dtype) * e.matrix),
            vector FLOPs / (g.fp32_flops * e.vector),
            bytes        / (g.hbm_bytes_per_s * e.memory))
        + e.kernel_floor_s

and a phase takes the sum over its kernels (one stream: kernels run one after
another). Default efficiencies, and why:

- ``matrix`` 0.6: cuBLAS reaches 70-80% of the dense peak on large bf16 products
  on H100/H200; a transformer step also runs narrow ones (key/value projections,
  attention with short heads) that reach less;
- ``vector`` 0.5: elementwise kernels are almost always bound by memory, so this
  rarely decides; half the peak allows for transcendental functions;
- ``memory`` 0.8: a streaming copy reaches 80-90% of the datasheet's HBM bandwidth;
- ``kernel_floor_s`` 5 microseconds: what an eager PyTorch op costs at the least,
  the launch and the host's dispatch (a tiny kernel is not free even when it moves
  nothing), so a step of many small kernels is bound by their number.

Not modelled: kernels that overlap on several streams, the host running behind the
GPU (a step whose kernels are shorter than their dispatch), caches (every byte is
read from HBM), clocks that drop under power limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError
from .gpu_specs import GpuSpec
from .op_costs import OpCost

BOUNDS = ("matrix", "vector", "memory", "floor")


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fraction of each peak that kernels reach (see the module docstring)."""

    matrix: float = 0.6
    vector: float = 0.5
    memory: float = 0.8
    kernel_floor_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("matrix", "vector", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise YafsdpError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.kernel_floor_s < 0:
            raise YafsdpError(f"kernel floor must be 0 or more seconds, got {self.kernel_floor_s}")


@dataclass(frozen=True, slots=True)
class PhaseTime:
    """A phase's time on one GPU, and how much of it each bound decided."""

    phase: str
    seconds: float
    kernels: int
    bound_s: dict[str, float]  # matrix | vector | memory | floor -> seconds


def kernel_time(
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    matrix_flops: float = 0,
    dtype: str = "bfloat16",
    vector_flops: float = 0,
    nbytes: float = 0,
) -> tuple[float, str]:
    """(seconds, the bound that decided) for one kernel."""
    times = {
        "matrix": matrix_flops / (gpu.matrix_peak(dtype) * eff.matrix),
        "vector": vector_flops / (gpu.fp32_flops * eff.vector),
        "memory": nbytes / (gpu.hbm_bytes_per_s * eff.memory),
    }
    bound = max(times, key=times.get)
    if times[bound] == 0:
        bound = "floor"
    return times.get(bound, 0.0) + eff.kernel_floor_s, bound


def op_time(op: OpCost, gpu: GpuSpec, eff: Efficiency) -> tuple[float, str]:
    return kernel_time(
        gpu,
        eff,
        matrix_flops=op.matrix_flops,
        dtype=op.dtype,
        vector_flops=op.vector_flops,
        nbytes=op.bytes,
    )


def phase_time(ops, phase: str, gpu: GpuSpec, eff: Efficiency | None = None) -> PhaseTime:
    """The sum of ``phase``'s kernels' times (``ops``: ``StepCosts.ops``)."""
    eff = eff or Efficiency()
    seconds, kernels = 0.0, 0
    bound_s = dict.fromkeys(BOUNDS, 0.0)
    for op in ops:
        if op.phase != phase:
            continue
        t, bound = op_time(op, gpu, eff)
        seconds += t
        kernels += 1
        bound_s[bound] += t
    return PhaseTime(phase, seconds, kernels, bound_s)
