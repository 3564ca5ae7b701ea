"""GPU memory that a step's allocation trace does not show: the CUDA context, cuBLAS
and cuBLASLt workspaces, NCCL's buffers.

``reserved_of`` predicts what the caching allocator reserves for the step's tensors;
a GPU must also hold what lives beside them. Each part is a rule with its source,
and each takes an override in bytes from the caller:

>>> out = outside_memory(torch_version="2.11.0", world_size=8, env={})
>>> [p.name for p in out.parts]
['CUDA context', 'cuBLAS workspaces', 'cuBLASLt workspaces', 'NCCL buffers']
>>> out.total == 804_061_184 + 2 * (32 << 20) + (1 << 20) + (4 << 20) * 16 * 2
True

[Note: where each part lives]
- The CUDA context (driver state, loaded kernel modules, cuBLAS's handles) is outside
  PyTorch entirely: ``torch.cuda.mem_get_info`` sees it, ``memory_reserved`` does not.
- cuBLAS and cuBLASLt workspaces come from the caching allocator, so
  ``torch.cuda.max_memory_reserved`` counts them, but no tensor of the step holds
  them and the trace does not see them; they stay cached across steps.
- NCCL allocates its buffers with the driver, outside the caching allocator.
Nothing here imports torch: the caller names the torch version and the GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import YafsdpError
from ..numbers import MAX_BYTES, MAX_COUNT, problem, shown

KIB, MIB = 1 << 10, 1 << 20

# CUDA context bytes by torch (major, minor): bytes the device has in use beyond what
# the caching allocator reserves, after two training steps of a bf16 transformer layer
# (kernels load lazily, so the figure grows as new kernels are first called).
# ``benchmarks/outside_cuda.py``; the run is kept in ``benchmarks/gpu/outside-h200.log``.
CONTEXT_MEASURED = {
    (2, 11): (804_061_184, "measured: H200, torch 2.11.0+cu130, lazy module loading"),
}
# CUDA_MODULE_LOADING=EAGER loads every kernel at start: same run, same machine.
CONTEXT_EAGER = {
    (2, 11): (1_951_203_328, "measured: H200, torch 2.11.0+cu130, CUDA_MODULE_LOADING=EAGER"),
}

# cuBLAS: aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: the
# default is ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB), 32 MiB (":4096:8") on Hopper
# (compute capability 9.x); CUBLAS_WORKSPACE_CONFIG=":SIZE:COUNT[:SIZE:COUNT...]" in
# KiB replaces it. Later sources give Blackwell (majors 10 and 12) 32 MiB too; which
# release first does is not checked here, so those GPUs get the general default.
CUBLAS_DEFAULT = 4096 * KIB * 2 + 16 * KIB * 8
CUBLAS_HOPPER = 4096 * KIB * 8
# One workspace per cuBLAS handle and stream; a handle belongs to a thread, and
# autograd runs backward on its own device thread: a training step on one stream holds
# two (measured: the first backward matmul allocates a second 32 MiB on the H200).
CUBLAS_HANDLES = 2
# cuBLASLt: parseCUDABlasLtWorkspaceSize: CUBLASLT_WORKSPACE_SIZE in KiB, default
# 1024; with TORCH_CUBLASLT_UNIFIED_WORKSPACE=1 it shares cuBLAS's workspace. torch
# 2.11 keeps it apart by default (measured: 1 MiB, 2 MiB with the variable at 2048).
# Only the forward's matmuls with a bias epilogue use it: one workspace per step.
CUBLASLT_DEFAULT_KIB = 1024
CUBLASLT_HANDLES = 1

# NCCL: its documentation (env.html, NCCL_BUFFSIZE) gives 4 MiB per buffer, "the size
# of the buffer that NCCL uses when communicating data between pairs of GPUs"; a
# ring (all-gather, reduce-scatter) connects each rank to 2 peers, one buffer per
# peer and channel: bytes = NCCL_BUFFSIZE x channels x min(world_size - 1, 2). The
# channel count is NCCL's choice per topology; 16 stands for an NVLink node (NCCL_
# MIN_NCHANNELS / NCCL_MAX_NCHANNELS set it). LL and LL128 protocol buffers and the
# proxy's host memory are not counted.
NCCL_BUFFSIZE_DEFAULT = 4 * MIB
NCCL_CHANNELS_DEFAULT = 16
NCCL_RING_PEERS = 2
HOPPER = (9, 0)


@dataclass(frozen=True, slots=True)
class OutsidePart:
    """One holder of GPU memory beside the step's tensors."""

    name: str
    bytes: int
    source: str  # where the figure comes from: a measurement, a default, a variable


@dataclass(frozen=True, slots=True)
class OutsideAllocator:
    """The parts, in a fixed order, and their sum."""

    parts: tuple[OutsidePart, ...]

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)


def outside_memory(
    *,
    torch_version: str,
    world_size: int = 1,
    capability: tuple[int, int] = HOPPER,
    env: Mapping[str, str] | None = None,
    context: int | None = None,
    cublas: int | None = None,
    cublaslt: int | None = None,
    nccl: int | None = None,
) -> OutsideAllocator:
    """The parts for a training process of ``torch_version`` on a GPU of
    ``capability``, one rank of ``world_size``, under the variables in ``env``
    (``os.environ`` as the process has it). An override (bytes) replaces its rule."""
    env = {} if env is None else env
    return OutsideAllocator(
        (
            _given("CUDA context", context) or context_part(torch_version, env),
            _given("cuBLAS workspaces", cublas) or cublas_part(capability, env),
            _given("cuBLASLt workspaces", cublaslt) or cublaslt_part(env),
            _given("NCCL buffers", nccl) or nccl_part(world_size, env),
        )
    )


def _given(name: str, value: int | None) -> OutsidePart | None:
    if value is None:
        return None
    if value < 0:
        raise YafsdpError(f"{name}: bytes must not be negative, got {value}")
    return OutsidePart(name, value, "given")


def torch_minor(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if not found:
        raise YafsdpError(f"torch version {version!r} is not MAJOR.MINOR[...]")
    return int(found.group(1)), int(found.group(2))


def context_part(torch_version: str, env: Mapping[str, str]) -> OutsidePart:
    """The measured context of this torch release, else of the nearest release
    measured (said so in the source)."""
    eager = env.get("CUDA_MODULE_LOADING", "").upper() == "EAGER"
    table = CONTEXT_EAGER if eager else CONTEXT_MEASURED
    want = torch_minor(torch_version)
    near = min(table, key=lambda v: (abs(v[0] - want[0]) * 100 + abs(v[1] - want[1]), v))
    size, source = table[near]
    if near != want:
        source = f"torch {want[0]}.{want[1]} not measured; torch {near[0]}.{near[1]}'s {source}"
    return OutsidePart("CUDA context", size, source)


def cublas_part(capability: tuple[int, int], env: Mapping[str, str]) -> OutsidePart:
    text = env.get("CUBLAS_WORKSPACE_CONFIG")
    if text:
        each, source = parse_cublas_config(text), f"CUBLAS_WORKSPACE_CONFIG={text}"
    elif capability[0] == 9:
        each, source = CUBLAS_HOPPER, "torch's default on compute capability 9.x (:4096:8)"
    else:
        each, source = CUBLAS_DEFAULT, "torch's default (:4096:2:16:8)"
    source += f", one per handle: {CUBLAS_HANDLES} (the step's thread and autograd's)"
    return OutsidePart("cuBLAS workspaces", each * CUBLAS_HANDLES, source)


def parse_cublas_config(text: str) -> int:
    """``":4096:2:16:8"`` -> bytes: the sum of SIZE KiB x COUNT over the pairs."""
    if not re.fullmatch(r"(:\d+:\d+)+", text.strip()):
        raise YafsdpError(
            f"CUBLAS_WORKSPACE_CONFIG={text!r} is not :SIZE:COUNT pairs in KiB "
            "(e.g. :4096:8); fix or unset it"
        )
    pairs = re.findall(r":(\d+):(\d+)", text)
    total = 0
    for size, count in pairs:  # each number bounded before the product: 1 EiB at most
        kib = _count("CUBLAS_WORKSPACE_CONFIG", size, "KiB", MAX_BYTES // KIB)
        total += kib * KIB * _count("CUBLAS_WORKSPACE_CONFIG", count, "workspaces", MAX_COUNT)
    if total > MAX_BYTES:
        raise YafsdpError(f"CUBLAS_WORKSPACE_CONFIG={shown(text)!r} asks for more than 1 EiB")
    return total


def cublaslt_part(env: Mapping[str, str]) -> OutsidePart:
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().lower()
    if unified in ("1", "true", "on", "yes"):
        return OutsidePart("cuBLASLt workspaces", 0, "TORCH_CUBLASLT_UNIFIED_WORKSPACE: cuBLAS's")
    text = env.get("CUBLASLT_WORKSPACE_SIZE")
    kib = (
        _count("CUBLASLT_WORKSPACE_SIZE", text, "KiB", MAX_BYTES // KIB)
        if text
        else CUBLASLT_DEFAULT_KIB
    )
    source = f"CUBLASLT_WORKSPACE_SIZE={text}" if text else "torch's default (1024 KiB)"
    return OutsidePart("cuBLASLt workspaces", kib * KIB * CUBLASLT_HANDLES, source)


def nccl_part(world_size: int, env: Mapping[str, str]) -> OutsidePart:
    if world_size < 1:
        raise YafsdpError(f"world size must be at least 1, got {world_size}")
    text = env.get("NCCL_BUFFSIZE")
    buff = _count("NCCL_BUFFSIZE", text, "bytes") if text else NCCL_BUFFSIZE_DEFAULT
    channels = nccl_channels(env)
    peers = min(world_size - 1, NCCL_RING_PEERS)
    source = f"NCCL_BUFFSIZE {buff} B x {channels} channels x {peers} ring peers" + (
        "" if text else " (NCCL's default buffer)"
    )
    return OutsidePart("NCCL buffers", buff * channels * peers, source)


def nccl_channels(env: Mapping[str, str]) -> int:
    """``NCCL_MIN_NCHANNELS`` raises the count, ``NCCL_MAX_NCHANNELS`` caps it."""
    low = env.get("NCCL_MIN_NCHANNELS")
    high = env.get("NCCL_MAX_NCHANNELS")
    channels = NCCL_CHANNELS_DEFAULT
    if low:
        channels = max(channels, _count("NCCL_MIN_NCHANNELS", low, "channels", MAX_COUNT))
    if high:
        channels = min(channels, _count("NCCL_MAX_NCHANNELS", high, "channels", MAX_COUNT))
    return channels


def _count(name: str, text: str, unit: str, high: int = MAX_BYTES) -> int:
    """A variable's whole number of ``unit``, from 0 to ``high`` (``numbers.problem``)."""
    try:
        value = int(text.strip())
    except ValueError:  # not digits, or more than Python converts
        value = -1
    if problem(value, 0, high, whole=True) is not None:
        raise YafsdpError(
            f"{name}={shown(text)!r} is not a whole number of {unit} from 0 to {high:,}; "
            "fix or unset it"
        )
    return value
