"""GPUs' figures for the step-time model, and a user's own GPU from a JSON file.

Every figure is the vendor's, from the datasheet named in ``source``; FLOP/s are
dense (the datasheets' headline tensor figures are "with sparsity", twice these).
``memory_bytes`` is what the driver reports as total (``nvidia-smi``'s MiB where it
differs from the marketing figure: an "80GB" H100 has 81,559 MiB), else the
vendor's figure in its own unit. ``link_bytes_per_s`` is one direction of one GPU's
intra-node link (NVLink, Infinity Fabric, PCIe): half the bidirectional figure the
datasheets print, because a ring collective sends one way while it receives the
other. ``fp32`` is the non-tensor-core rate: what float32 matrix products run at
with torch's defaults (TF32 off for ``matmul``) and what vector ops are bounded by.

A profile of one's own GPU is a JSON object with the fields of
``yafsdp_cli/schemas/gpu.schema.json``, in TFLOP/s and GB/s (10^12, 10^9)::

    {"name": "my-gpu", "memory_bytes": 85899345920, "bf16_tflops": 900,
     "fp8_tflops": 1800, "fp32_tflops": 60, "hbm_gbps": 3000, "link_gbps": 400,
     "gpus_per_node": 8, "source": "measured"}

Every figure is a finite number in a physical range (``BOUNDS``; ``NaN``,
``Infinity`` and ``1e400`` are refused naming the field), and the file is at most
``MAX_PROFILE_BYTES`` (1 MiB; a calibrated profile is about 1 KB), refused before
it is parsed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import YafsdpError
from ..fileio import read_json
from ..gpu_table import ROWS
from ..numbers import (
    MAX_BYTES,
    MAX_BYTES_PER_S,
    MAX_COUNT,
    MAX_FLOPS,
    MIN_RATE,
    checked,
    shown,
)

TERA, GIGA = 1e12, 1e9
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "gpu.schema.json"
MAX_PROFILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_flops: float  # dense bf16/fp16 tensor FLOP/s
    fp8_flops: float  # dense fp8 tensor FLOP/s; 0 where the GPU has none
    fp32_flops: float  # non-tensor float32 FLOP/s: float32 matrix and vector ops
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # intra-node, one direction, per GPU
    gpus_per_node: int
    source: str

    def matrix_peak(self, dtype: str) -> float:
        """The peak FLOP/s of a matrix product whose inputs are ``dtype``."""
        if dtype in ("bfloat16", "float16"):
            return self.bf16_flops
        if dtype.startswith("float8") and self.fp8_flops:
            return self.fp8_flops
        return self.fp32_flops


def _gpu(name, memory, bf16, fp8, fp32, hbm, link, per_node, source) -> GpuSpec:
    """A row of the table in the datasheets' units: TFLOP/s and GB/s."""
    return GpuSpec(
        name,
        memory,
        bf16 * TERA,
        fp8 * TERA,
        fp32 * TERA,
        hbm * GIGA,
        link * GIGA,
        per_node,
        source,
    )


GPUS = {row[0].lower(): _gpu(*row[:8], row[9]) for row in ROWS}


def gpu_spec(name: str) -> GpuSpec:
    """The GPU called ``name`` (any case)."""
    found = GPUS.get(name.lower())
    if found is None:
        known = ", ".join(g.name for g in GPUS.values())
        raise YafsdpError(f"unknown GPU {name!r}; known: {known}; or give a JSON profile file")
    return found


PROFILE_KEYS = {
    "name": str,
    "memory_bytes": int,
    "bf16_tflops": (int, float),
    "fp8_tflops": (int, float),
    "fp32_tflops": (int, float),
    "hbm_gbps": (int, float),
    "link_gbps": (int, float),
    "gpus_per_node": int,
}
OPTIONAL = {"fp8_tflops": 0, "source": "user profile"}
# each number's range, as ``numbers.checked`` takes it: the rates in the file's units
# (TFLOP/s, GB/s) from ``numbers.MIN_RATE`` to ``numbers.MAX_FLOPS`` and
# ``numbers.MAX_BYTES_PER_S``
BOUNDS = {
    "memory_bytes": (1, MAX_BYTES),
    "bf16_tflops": (MIN_RATE / TERA, MAX_FLOPS / TERA),
    "fp8_tflops": (MIN_RATE / TERA, MAX_FLOPS / TERA),  # or 0: no fp8 units
    "fp32_tflops": (MIN_RATE / TERA, MAX_FLOPS / TERA),
    "hbm_gbps": (MIN_RATE / GIGA, MAX_BYTES_PER_S / GIGA),
    "link_gbps": (MIN_RATE / GIGA, MAX_BYTES_PER_S / GIGA),
    "gpus_per_node": (1, MAX_COUNT),
}


def read_profile_json(path: Path):
    """The JSON document of a GPU profile file, at most ``MAX_PROFILE_BYTES``."""
    return read_json(path, error=YafsdpError, cap=MAX_PROFILE_BYTES)


def load_gpu(path: str | Path) -> GpuSpec:
    """A GPU profile from a JSON file (``schemas/gpu.schema.json``); every problem is
    one line naming the file and the field."""
    path = Path(path)
    return gpu_from_dict(read_profile_json(path), where=str(path))


def gpu_from_dict(doc, where: str = "GPU profile") -> GpuSpec:
    if not isinstance(doc, dict):
        raise YafsdpError(f"{where}: a GPU profile is a JSON object, got {type(doc).__name__}")
    # a calibrated profile's efficiencies and record are ``gpu_profile``'s to read
    doc = {k: v for k, v in doc.items() if k not in ("efficiency", "calibration")}
    extra = sorted(set(doc) - set(PROFILE_KEYS) - set(OPTIONAL))
    if extra:
        raise YafsdpError(f"{where}: unknown field {extra[0]!r}; fields: {', '.join(PROFILE_KEYS)}")
    doc = {**OPTIONAL, **doc}
    for key, kind in PROFILE_KEYS.items():
        _check_field(doc, key, kind, where)
    if not isinstance(doc["source"], str):
        raise YafsdpError(f"{where}: 'source' must be a string")
    return _gpu(
        doc["name"], doc["memory_bytes"], doc["bf16_tflops"], doc["fp8_tflops"],
        doc["fp32_tflops"], doc["hbm_gbps"], doc["link_gbps"], doc["gpus_per_node"],
        doc["source"],
    )  # fmt: skip


def _check_field(doc: dict, key: str, kind, where: str) -> None:
    if key not in doc:
        raise YafsdpError(f"{where}: missing field {key!r}")
    value = doc[key]
    if kind is str:
        if not isinstance(value, str):
            raise YafsdpError(f"{where}: {key!r} must be a string, got {shown(repr(value))}")
        if not value.strip():
            raise YafsdpError(f"{where}: {key!r} must not be empty")
        return
    if isinstance(value, bool) or not isinstance(value, kind):
        want = "an integer" if kind is int else "a number"
        raise YafsdpError(f"{where}: {key!r} must be {want}, got {shown(repr(value))}")
    low, high = BOUNDS[key]
    if key == "fp8_tflops" and value == 0:
        return
    if value == 0 or (isinstance(value, int | float) and value < 0):
        raise YafsdpError(f"{where}: {key!r} must be positive, got {shown(repr(value))}")
    checked(value, f"{where}: {key!r}", low, high, whole=kind is int)


def resolve_gpu(name_or_path: str) -> GpuSpec:
    """A known GPU's name, or the path of a JSON profile (ends in ``.json``)."""
    if name_or_path.lower().endswith(".json"):
        return load_gpu(name_or_path)
    return gpu_spec(name_or_path)
