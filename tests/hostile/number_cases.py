"""Hostile numbers: every numeric option, GPU-profile field, baseline figure and
allocator setting given values that are no number a user means (NaN, infinities,
1e400, a negative, an integer of 400 digits), built here, not stored.

Each case is the command line that gives the number, and a regex the one error line
must match: the option, or the file and its field, or where an allocator setting
came from (``--alloc-conf`` or ``PYTORCH_CUDA_ALLOC_CONF``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# what Python reads as a float (nan, inf, 1e400: inf), or as an int of any size
BAD_NUMBERS = ("nan", "inf", "-inf", "1e400", "1e999", "-1", "1" + "0" * 400)
# the same as JSON text: its NaN and Infinity literals, which Python's json accepts
BAD_JSON = ("NaN", "Infinity", "-Infinity", "1e400", "1e999", "-1", "1" + "0" * 400)

LLAMA = ("--model", "sample_models.models:llama")
GPU_MEMORY = ("--gpu-memory", "80GiB")
ALLOC_VAR = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True)
class OptionCase:
    """``yafsdp COMMAND ... OPTION TEMPLATE.format(number)``, or the number in the
    environment variable ``env`` (``option`` then names the variable)."""

    command: str
    option: str
    template: str = "{}"  # how the number is written: "{}GiB", "context={}GiB"
    rest: tuple[str, ...] = ()  # the rest of the command line; "{folder}" is the case's
    env: str | None = None

    @property
    def id(self) -> str:
        text = self.template.replace("{}", "N").replace("/", "per")
        return f"{self.command}{self.option}={text}"

    def argv(self, folder: Path, number: str) -> tuple[list[str], dict[str, str]]:
        rest = [a.replace("{folder}", str(folder)) for a in self.rest]
        value = self.template.format(number)
        if self.env is not None:
            return [self.command, *rest], {self.env: value}
        return [self.command, *rest, self.option, value], {}


def _alloc(command: str, rest: tuple[str, ...]) -> list[OptionCase]:
    """Each numeric allocator setting, through ``--alloc-conf`` and the variable."""
    settings = (
        "max_split_size_mb:{}",
        "max_non_split_rounding_mb:{}",
        "garbage_collection_threshold:{}",
        "roundup_power2_divisions:{}",
        "roundup_power2_divisions:[{}:2]",
        "roundup_power2_divisions:[64:{}]",
    )
    out = [OptionCase(command, "--alloc-conf", s, rest) for s in settings]
    out += [OptionCase(command, ALLOC_VAR, s, rest, env=ALLOC_VAR) for s in settings[:3]]
    return out


PLAN = (*LLAMA, *GPU_MEMORY)
PROFILE = (*LLAMA, "--fake")
CHECK = ("sample_models/mlp.safetensors", "--baseline", "{folder}/b.json")
VERIFY = LLAMA
CONVERT = ("{folder}/in.safetensors", "-o", "{folder}/out.safetensors")

OPTIONS: list[OptionCase] = [
    # plan: sizes, shares, rates, counts, lists
    OptionCase("plan", "--gpu-memory", "{}GiB", LLAMA),
    OptionCase("plan", "--gpu-memory", "{}", LLAMA),
    OptionCase("plan", "--reserve", "{}GiB", PLAN),
    OptionCase("plan", "--margin", "{}GiB", PLAN),
    OptionCase("plan", "--margin", "{}%", PLAN),
    OptionCase("plan", "--outside", "context={}GiB", PLAN),
    OptionCase("plan", "--network", "{}GB/s", (*LLAMA, "--gpu", "h100-sxm")),
    OptionCase("plan", "--tokens", "{}", (*LLAMA, "--gpu", "h100-sxm")),
    OptionCase("plan", "--world-size", "{}", PLAN),
    OptionCase("plan", "--world-size", "1,{}", PLAN),
    OptionCase("plan", "--micro-batch", "{}", PLAN),
    OptionCase("plan", "--seq-len", "{}", PLAN),
    OptionCase("plan", "--jobs", "{}", PLAN),
    OptionCase("plan", "--seed", "{}", PLAN),
    *_alloc("plan", PLAN),
    # what a rank holds beside the allocator, from the environment
    *(
        OptionCase("plan", name, template, PLAN, env=name)
        for name, template in (
            ("NCCL_BUFFSIZE", "{}"),
            ("NCCL_MIN_NCHANNELS", "{}"),
            ("NCCL_MAX_NCHANNELS", "{}"),
            ("CUBLASLT_WORKSPACE_SIZE", "{}"),
            ("CUBLAS_WORKSPACE_CONFIG", ":{}:8"),
            ("CUBLAS_WORKSPACE_CONFIG", ":4096:{}"),
        )
    ),
    # profile
    OptionCase("profile", "--batch", "{}", PROFILE),
    OptionCase("profile", "--seq-len", "{}", PROFILE),
    OptionCase("profile", "--seed", "{}", PROFILE),
    OptionCase("profile", "--world-size", "{}", PROFILE),
    OptionCase("profile", "--modules", "{}", PROFILE),
    OptionCase("profile", "--depth", "{}", PROFILE),
    OptionCase("profile", "--input-shape", "2,{}", PROFILE),
    *_alloc("profile", (*PROFILE, "--target", "cuda")),
    # inspect
    OptionCase("inspect", "--world-size", "{}", LLAMA),
    OptionCase("inspect", "--round-bytes", "{}", LLAMA),
    OptionCase("inspect", "--align", "{}", LLAMA),
    # check
    OptionCase("check", "--tolerance", "{}", CHECK),
    OptionCase("check", "--step-tolerance", "{}", CHECK),
    OptionCase("check", "--batch", "{}", CHECK),
    OptionCase("check", "--seq-len", "{}", CHECK),
    OptionCase("check", "--world-size", "{}", CHECK),
    # verify
    OptionCase("verify", "--steps", "{}", VERIFY),
    OptionCase("verify", "--micro-batches", "{}", VERIFY),
    OptionCase("verify", "--atol", "{}", VERIFY),
    OptionCase("verify", "--rtol", "{}", VERIFY),
    OptionCase("verify", "--top", "{}", VERIFY),
    OptionCase("verify", "--batch", "{}", VERIFY),
    OptionCase("verify", "--blocks", "{}", VERIFY),
    # calibrate (the options are read before any GPU is looked for)
    OptionCase("calibrate", "--seq-len", "{}", LLAMA),
    OptionCase("calibrate", "--steps", "{}", LLAMA),
    OptionCase("calibrate", "--batch", "{}", LLAMA),
    # convert and reshard: the number of ranks
    OptionCase("convert", "--world-size", "{}", CONVERT),
    OptionCase("reshard", "--world-size", "{}", CONVERT),
]


# -------------------------------------------------------------------- files

GPU_PROFILE = {
    "name": "hostile",
    "memory_bytes": 85899345920,
    "bf16_tflops": 900,
    "fp8_tflops": 1800,
    "fp32_tflops": 60,
    "hbm_gbps": 3000,
    "link_gbps": 400,
    "gpus_per_node": 8,
    "efficiency": {"matrix": 0.7, "vector": 0.5, "memory": 0.8, "kernel_floor_us": 5},
}
PROFILE_FIELDS = (
    "memory_bytes",
    "bf16_tflops",
    "fp8_tflops",
    "fp32_tflops",
    "hbm_gbps",
    "link_gbps",
    "gpus_per_node",
    "efficiency.matrix",
    "efficiency.vector",
    "efficiency.memory",
    "efficiency.kernel_floor_us",
)
MARK = "__NUMBER__"


def with_raw(doc: dict, dotted: str, raw: str) -> str:
    """``doc`` as JSON text with the field ``dotted`` (``efficiency.matrix``) written
    as ``raw``, JSON text that ``json.dumps`` would never write (``NaN``, ``1e400``)."""
    doc = json.loads(json.dumps(doc))
    *parents, key = dotted.split(".")
    inner = doc
    for name in parents:
        inner = inner[name]
    inner[key] = MARK
    return json.dumps(doc).replace(json.dumps(MARK), raw)


@dataclass(frozen=True)
class FileCase:
    """A file ``build(folder)`` writes, given to ``argv(path)``; the one error line
    must name the file and match ``message``."""

    id: str
    build: Callable[[Path], Path]
    argv: Callable[[Path], list[str]]
    message: str
    patch: dict = field(default_factory=dict)  # module attribute -> value (a smaller cap)


def _writer(name: str, text: str | bytes) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        path = folder / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    return build


def _plan_with(path: Path) -> list[str]:
    return ["plan", *LLAMA, "--gpu-profile", str(path)]


def _plan_json_with(path: Path) -> list[str]:
    return [*_plan_with(path), "--json"]


def _check_with(path: Path) -> list[str]:
    return ["check", "sample_models/mlp.safetensors", "--baseline", str(path), "--no-step"]


def profile_cases() -> list[FileCase]:
    out = []
    for dotted in PROFILE_FIELDS:
        key = dotted.rsplit(".", 1)[-1]
        for raw in BAD_JSON:
            text = with_raw(GPU_PROFILE, dotted, raw)
            out.append(
                FileCase(f"profile-{dotted}={raw[:8]}", _writer("gpu.json", text), _plan_with, key)
            )
    # a rate so small that a time divided by it is infinite, as --json cannot print
    for dotted in PROFILE_FIELDS:
        if dotted not in ("memory_bytes", "gpus_per_node", "efficiency.kernel_floor_us"):
            text = with_raw(GPU_PROFILE, dotted, "1e-300")
            build = _writer("gpu.json", text)
            key = dotted.rsplit(".", 1)[-1]
            out.append(FileCase(f"profile-{dotted}=1e-300", build, _plan_json_with, key))
    nan = with_raw(GPU_PROFILE, "bf16_tflops", "NaN")
    out += [
        FileCase("profile-nan-json", _writer("gpu.json", nan), _plan_json_with, "bf16_tflops"),
        FileCase(
            "profile-over-cap",
            _writer("gpu.json", json.dumps({**GPU_PROFILE, "name": "x" * (1 << 20)})),
            _plan_with,
            "more than 1048576 bytes",
        ),
        FileCase(
            "profile-deep",
            _writer("gpu.json", "[" * 100_000 + "]" * 100_000),
            _plan_with,
            "nested too deeply",
        ),
        FileCase(
            "profile-5000-digits",
            _writer("gpu.json", with_raw(GPU_PROFILE, "memory_bytes", "7" * 5000)),
            _plan_with,
            "thousands of digits",
        ),
    ]
    return out


BASELINE = {
    "schema": "yafsdp.baseline/2",
    "source": {"path": "sample_models/mlp.safetensors", "model": None, "kind": "safetensors"},
    "inputs": {"world_size": 1, "round_bytes": 512},
    "memory": {
        "flat_bytes": 1000,
        "flat_persistent_bytes": 800,
        "ddp_bytes": 2000,
        "largest_unit_bytes": 100,
        "parameters": 250,
    },
    "step": None,
}
BASELINE_FIELDS = (
    "memory.flat_bytes",
    "memory.flat_persistent_bytes",
    "memory.ddp_bytes",
    "memory.largest_unit_bytes",
    "memory.parameters",
    "inputs.world_size",
    "inputs.round_bytes",
)
PLAN_BASELINE = {
    "schema": "yafsdp.plan/1",
    "model": "sample_models.models:llama",
    "options": {"gpu": "h100-sxm", "gpu_memory": 85899345920, "tokens": 10**9, "network": 5e10},
    "rows": [],
}


def baseline_cases() -> list[FileCase]:
    out = []
    for dotted in BASELINE_FIELDS:
        key = dotted.rsplit(".", 1)[-1].replace("_", "[-_]")
        for raw in BAD_JSON:
            text = with_raw(BASELINE, dotted, raw)
            case = FileCase(
                f"baseline-{dotted}={raw[:8]}", _writer("b.json", text), _check_with, key
            )
            out.append(case)
    for dotted in ("options.gpu_memory", "options.tokens", "options.network"):
        for raw in BAD_JSON:
            text = with_raw(PLAN_BASELINE, dotted, raw)
            key = dotted.split(".")[1].replace("_", "[-_]")
            case = FileCase(
                f"plan-baseline-{dotted}={raw[:8]}", _writer("p.json", text), _check_with, key
            )
            out.append(case)
    out.append(
        FileCase(
            "baseline-over-cap",
            _writer("b.json", json.dumps({**BASELINE, "skipped": ["x" * 5000]})),
            _check_with,
            "more than 4096 bytes",
            patch={"yafsdp_cli.gate.baseline.MAX_BASELINE_BYTES": 4096},
        )
    )
    return out


FILES: list[FileCase] = profile_cases() + baseline_cases()
