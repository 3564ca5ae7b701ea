"""The step-time model: how long one training step takes on a given GPU and cluster.

Owns the per-kernel costs of a fake step (``op_costs``: matrix and vector FLOPs,
bytes, kernels, counted as ``profile --fake`` runs the step; ``step_costs``: the
step and its per-phase totals), the roofline that turns them into time
(``roofline``), the GPUs' figures (``gpu_specs``, with the schema of a user's own
profile in ``schemas/gpu.schema.json``; ``gpu_profile``: a profile file with its
measured efficiencies), the bytes each scheme's collectives move and their ring
time (``comm_volume``), a configuration's step estimate with the chooser of the best
one (``step_estimate``), and the measurement of a device into a profile
(``calibrate``, the library half of ``yafsdp calibrate``). It may import ``profiling``, ``memory``,
``schemes``, ``engine`` and ``errors``; ``planning``, ``report`` and ``cli`` may import it.
"""

from .comm_volume import Cluster, Collective, collectives, ring_time, sent_bytes
from .gpu_specs import GPUS, GpuSpec, gpu_spec, load_gpu, resolve_gpu
from .op_costs import OpCost, OpCounter
from .roofline import Efficiency, PhaseTime, kernel_time, phase_time
from .step_costs import PhaseCosts, StepCosts, count_step
from .step_estimate import (
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    Choice,
    StepEstimate,
    TimedCell,
    best_cell,
    estimate_step,
    exposed_time,
)

__all__ = [
    "DEFAULT_OBJECTIVE",
    "GPUS",
    "OBJECTIVES",
    "Choice",
    "Cluster",
    "Collective",
    "Efficiency",
    "GpuSpec",
    "OpCost",
    "OpCounter",
    "PhaseCosts",
    "PhaseTime",
    "StepCosts",
    "StepEstimate",
    "TimedCell",
    "best_cell",
    "collectives",
    "count_step",
    "estimate_step",
    "exposed_time",
    "gpu_spec",
    "kernel_time",
    "load_gpu",
    "phase_time",
    "resolve_gpu",
    "ring_time",
    "sent_bytes",
]
