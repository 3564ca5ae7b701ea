"""``yafsdp plan``: will training fit, and on how many GPUs?

The room above ``profiling``: it combines the memory model (``memory``) with fake
runs of the converted model's step (``profiling``) into a grid of world size x
micro-batch x activation checkpointing. ``report`` renders it; ``cli`` calls it.

Owns what a plan is asked (``plan_options``) and what it answers (``plan_report``),
the grid (``fit_grid``) and its key, a ``Cell`` of a mesh, a micro-batch and a
checkpointing choice (``cell``), the fake steps that measure every cell
(``measure``), each cell's reserved peak and the memory beside the allocator
(``reserved_fit``), each cell's step time on a named GPU and the best row by an
objective (``cell_time``), the processes that run them at once (``pool``) and the
other training schemes' peaks over the same grid (``scheme_peaks``, ``plan --scheme``).
It may import ``timing``, ``profiling``, ``verify`` (the memory this process may use),
``inspect``,
``memory``, ``schemes``, ``sources``, ``engine`` and ``errors``.

>>> from yafsdp_cli.planning import PlanOptions, plan_source
>>> report = plan_source(None, model="sample_models.models:gpt",
...                      opts=PlanOptions(gpu_memory=2**30))  # doctest: +SKIP
>>> report.best.fits  # doctest: +SKIP
True
"""

from ..options.sizes import gpu_memory_notes, parse_size
from .fit_grid import context_length, plan_model, plan_source
from .plan_options import PlanOptions, parse_ints
from .plan_report import (
    SCHEMA,
    PlanBreakdown,
    PlanReport,
    PlanRow,
    PlanTiming,
    Smallest,
)

__all__ = [
    "SCHEMA",
    "PlanBreakdown",
    "PlanOptions",
    "PlanReport",
    "PlanRow",
    "PlanTiming",
    "Smallest",
    "context_length",
    "plan_model",
    "parse_ints",
    "gpu_memory_notes",
    "parse_size",
    "plan_source",
]
