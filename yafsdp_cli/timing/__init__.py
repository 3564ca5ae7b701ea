"""The step-time model: how long one training step takes on a given GPU and cluster.

Owns the per-kernel costs of a fake step (``op_costs``: matrix and vector FLOPs,
bytes, kernels, counted as ``profile --fake`` runs the step; ``step_costs``: the
step and its per-phase totals), the roofline that turns them into time
(``roofline``), the GPUs' figures (``gpu_specs``, with the schema of a user's own
profile in ``schemas/gpu.schema.json``), the bytes each scheme's collectives move
and their ring time (``comm_volume``), and a configuration's step estimate with the
chooser of the best one (``step_estimate``). It may import ``profiling``, ``memory``,
``engine`` and ``errors``; ``planning``, ``report`` and ``cli`` may import it.
"""
