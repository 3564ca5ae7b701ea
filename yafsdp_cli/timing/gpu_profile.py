"""A GPU profile file: a GPU's figures and, where measured, its kernels' efficiencies.

The file is the JSON object of ``schemas/gpu.schema.json``: the figures
``gpu_specs.load_gpu`` reads, plus two optional keys that ``yafsdp calibrate``
writes, so that ``plan --gpu-profile`` times kernels as the measured GPU runs them:

- ``efficiency``: ``matrix``, ``vector``, ``memory``, ``attention_forward``,
  ``attention_backward`` (fractions of the peaks, in (0, 1]), ``kernel_floor_us``
  (the least a kernel costs, microseconds), ``matrix_half_dim`` and
  ``attention_half_seq`` (the shape factors' half points): the roofline's
  ``Efficiency``; absent keys keep the published ones of the GPU the profile names
  (``roofline.efficiency_for``: a known row's name), else the generic defaults;
- ``calibration``: what was measured and how (free-form; recorded, never read back
  into the model).

>>> profile = profile_from_dict({"name": "g", "memory_bytes": 1, "bf16_tflops": 1,
...     "fp32_tflops": 1, "hbm_gbps": 1, "link_gbps": 1, "gpus_per_node": 1,
...     "efficiency": {"matrix": 0.7}})
>>> profile.efficiency.matrix, profile.efficiency.memory
(0.7, 0.8)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import YafsdpError
from ..numbers import MIN_EFFICIENCY, checked, shown
from .gpu_specs import GIGA, TERA, GpuSpec, gpu_from_dict, read_profile_json
from .roofline import Efficiency, efficiency_for

EFFICIENCY_KEYS = (
    "matrix",
    "vector",
    "memory",
    "kernel_floor_us",
    "matrix_half_dim",
    "attention_forward",
    "attention_backward",
    "attention_half_seq",
)


@dataclass(frozen=True, slots=True)
class GpuProfile:
    gpu: GpuSpec
    efficiency: Efficiency
    calibration: dict = field(default_factory=dict)


def load_profile(path: str | Path) -> GpuProfile:
    """The profile in ``path``; every problem is one line naming the file and the key."""
    path = Path(path)
    return profile_from_dict(read_profile_json(path), where=str(path))


def profile_from_dict(doc, where: str = "GPU profile") -> GpuProfile:
    if not isinstance(doc, dict):
        raise YafsdpError(f"{where}: a GPU profile is a JSON object, got {type(doc).__name__}")
    gpu = gpu_from_dict(doc, where)
    calibration = doc.get("calibration", {})
    if not isinstance(calibration, dict):
        raise YafsdpError(f"{where}: 'calibration' must be an object")
    return GpuProfile(gpu, _efficiency(doc.get("efficiency", {}), where, gpu), calibration)


def _efficiency(doc, where: str, gpu: GpuSpec) -> Efficiency:
    """The profile's efficiencies over the published ones of the GPU it names
    (``roofline.efficiency_for``): a key the file leaves out keeps those."""
    if not isinstance(doc, dict):
        raise YafsdpError(f"{where}: 'efficiency' must be an object with {EFFICIENCY_KEYS}")
    extra = sorted(set(doc) - set(EFFICIENCY_KEYS))
    if extra:
        raise YafsdpError(
            f"{where}: unknown efficiency {extra[0]!r}; keys: {', '.join(EFFICIENCY_KEYS)}"
        )
    for key, value in doc.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise YafsdpError(
                f"{where}: efficiency {key!r} must be a number, got {shown(repr(value))}"
            )
        if key in ("kernel_floor_us", "matrix_half_dim", "attention_half_seq"):
            # at most a second, a million elements: no launch or tile is larger
            checked(value, f"{where}: efficiency {key!r}", 0, 1e6)
        elif 0 < value < MIN_EFFICIENCY:  # above 1, NaN and inf: ``Efficiency`` says so
            raise YafsdpError(
                f"{where}: efficiency {key!r} must be at least {MIN_EFFICIENCY:g}, got {value!r}"
            )
    given = {k: v for k, v in doc.items() if k != "kernel_floor_us"}
    if "kernel_floor_us" in doc:
        given["kernel_floor_s"] = doc["kernel_floor_us"] * 1e-6
    try:
        return dataclasses.replace(efficiency_for(gpu), **given)
    except YafsdpError as exc:
        raise YafsdpError(f"{where}: {exc}") from None


def profile_to_dict(profile: GpuProfile) -> dict:
    """The JSON object of ``profile`` (what ``load_profile`` reads back)."""
    g, e = profile.gpu, profile.efficiency
    doc = {
        "name": g.name,
        "memory_bytes": g.memory_bytes,
        "bf16_tflops": g.bf16_flops / TERA,
        "fp8_tflops": g.fp8_flops / TERA,
        "fp32_tflops": g.fp32_flops / TERA,
        "hbm_gbps": g.hbm_bytes_per_s / GIGA,
        "link_gbps": g.link_bytes_per_s / GIGA,
        "gpus_per_node": g.gpus_per_node,
        "source": g.source,
        "efficiency": {
            "matrix": e.matrix,
            "vector": e.vector,
            "memory": e.memory,
            "kernel_floor_us": e.kernel_floor_s * 1e6,
            "matrix_half_dim": e.matrix_half_dim,
            "attention_half_seq": e.attention_half_seq,
            **{
                k: getattr(e, k)
                for k in ("attention_forward", "attention_backward")
                if getattr(e, k) is not None
            },
        },
    }
    if profile.calibration:
        doc["calibration"] = profile.calibration
    return doc


def write_profile(path: str | Path, profile: GpuProfile) -> None:
    """``profile`` to ``path``: a temporary file beside it, renamed into place, so a
    failure leaves no half-written profile."""
    path = Path(path)
    text = json.dumps(profile_to_dict(profile), indent=2, allow_nan=False) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise YafsdpError(f"{path}: cannot write the GPU profile there ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
