"""``yafsdp plan``: will training fit, and on how many GPUs?

The room above ``profiling``: it combines the memory model (``memory``) with fake
runs of the converted model's step (``profiling``) into a grid of world size x
micro-batch x activation checkpointing. ``report`` renders it; ``cli`` calls it.

Owns what a plan is asked (``plan_options``) and what it answers (``plan_report``),
the grid (``fit_grid``), the fake runs and the lines fitted through them
(``measure``) and the processes that run them at once (``pool``). It may import
``profiling``, ``verify`` (the memory this process may use), ``inspect``,
``memory``, ``sources``, ``engine`` and ``errors``.

>>> from yafsdp_cli.planning import PlanOptions, plan_source
>>> report = plan_source(None, model="sample_models.models:gpt",
...                      opts=PlanOptions(gpu_memory=2**30))  # doctest: +SKIP
>>> report.best.fits  # doctest: +SKIP
True
"""

from .fit_grid import context_length, plan_model, plan_source
from .plan_options import (
    DEFAULT_RESERVE,
    PlanOptions,
    gpu_memory_notes,
    parse_ints,
    parse_size,
)
from .plan_report import SCHEMA, LinearityCheck, PlanBreakdown, PlanReport, PlanRow, Smallest

__all__ = [
    "DEFAULT_RESERVE",
    "SCHEMA",
    "LinearityCheck",
    "PlanBreakdown",
    "PlanOptions",
    "PlanReport",
    "PlanRow",
    "Smallest",
    "context_length",
    "plan_model",
    "parse_ints",
    "gpu_memory_notes",
    "parse_size",
    "plan_source",
]
