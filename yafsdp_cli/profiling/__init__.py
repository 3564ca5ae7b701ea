"""``yafsdp profile``: measured peak memory of one training step, original vs converted.

Owns what profile is asked (``profile_options``) and what it answers
(``profile_report``), the two steps it takes (``profiler``), the storage tracker
(``tracker``, with module names from ``modules``) and the replay of what it recorded
(``timeline``), a sharded step's sizes at another world size (``shard_sizes``, what
``plan`` takes its runs at other world sizes from), the fake step and the kernels it
substitutes (``fake``, ``kernels``), mixed precision (``precision``) and the check of
sequence lengths (``positions``), and what a GPU holds for a step under
``--target cuda`` (``gpu_holding``: the caching allocator's replay and the memory
beside it). It may import ``sources``, ``memory``, ``engine`` and ``errors``;
``planning``, ``gate``, ``report`` and ``cli`` import it.

>>> from yafsdp_cli.profiling import ProfileOptions, profile_source
>>> report = profile_source(None, model="sample_models.models:gpt",
...                         opts=ProfileOptions(fake=True))  # doctest: +SKIP
>>> report.converted_step.peak.total <= report.original.peak.total  # doctest: +SKIP
True
"""

from __future__ import annotations

from .profile_options import ProfileOptions
from .profile_report import (
    SCHEMA,
    CudaMemory,
    ModuleShare,
    ProfileReport,
    ReservedPeak,
    StepProfile,
)
from .profiler import profile_model, profile_source
from .timeline import CATEGORIES, Breakdown, ModuleMemory
from .tracker import StorageTracker

__all__ = [
    "ReservedPeak",
    "CATEGORIES",
    "SCHEMA",
    "Breakdown",
    "CudaMemory",
    "ModuleMemory",
    "ModuleShare",
    "ProfileOptions",
    "ProfileReport",
    "StepProfile",
    "StorageTracker",
    "profile_model",
    "profile_source",
]
