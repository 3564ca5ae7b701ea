"""``yafsdp profile``: measured peak memory of one training step, original vs converted.

>>> from yafsdp_cli.profiling import ProfileOptions, profile_source
>>> report = profile_source(None, model="sample_models.models:gpt",
...                         opts=ProfileOptions(fake=True))  # doctest: +SKIP
>>> report.converted_step.peak.total <= report.original.peak.total  # doctest: +SKIP
True
"""

from __future__ import annotations

from .profile_options import ProfileOptions
from .profile_report import SCHEMA, CudaMemory, ModuleShare, ProfileReport, StepProfile
from .profiler import profile_model, profile_source
from .tracker import CATEGORIES, Breakdown, ModuleMemory, StorageTracker

__all__ = [
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
