"""The roofline: each kernel takes as long as its slowest resource, plus a floor.

For one kernel on a GPU ``g`` with efficiencies ``e``::

    t = max(matrix FLOPs / (g.matrix_peak(dtype) * e.matrix),
            vector FLOPs / (g.fp32_flops * e.vector),
            bytes        / (g.hbm_bytes_per_s * e.memory))
        + e.kernel_floor_s

and a phase takes the sum over its kernels (one stream: kernels run one after
another). Default efficiencies, and why:

- ``matrix`` 0.6: cuBLAS reaches 70-80% of the dense peak on large bf16 products
  on H100/H200; a transformer step also runs narrow ones (key/value projections,
  attention with short heads) that reach less;
- ``vector`` 0.5: elementwise kernels are almost always bound by memory, so this
  rarely decides; half the peak allows for transcendental functions;
- ``memory`` 0.8: a streaming copy reaches 80-90% of the datasheet's HBM bandwidth;
- ``kernel_floor_s`` 5 microseconds: what an eager PyTorch op costs at the least,
  the launch and the host's dispatch (a tiny kernel is not free even when it moves
  nothing), so a step of many small kernels is bound by their number.

Not modelled: kernels that overlap on several streams, the host running behind the
GPU (a step whose kernels are shorter than their dispatch), caches (every byte is
read from HBM), clocks that drop under power limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError
from .gpu_specs import GpuSpec
from .op_costs import OpCost

# what decides a kernel's time above its launch floor: its products (``attention``:
# a flash attention kernel's), its vector FLOPs or its bytes; ``floor`` is the floors
BOUNDS = ("matrix", "attention", "vector", "memory", "floor")


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """The fraction of each peak that kernels reach (see the module docstring).

    ``matrix``: a large product's share of the dense peak; a product whose smallest
    side is ``d`` reaches ``matrix * d / (d + matrix_half_dim)``. ``attention_forward``
    and ``attention_backward``: the flash kernels' share of the dense peak at head
    dimension 128 and a long sequence; at sequence ``s`` and head dimension ``h``
    they reach that times ``s / (s + attention_half_seq)`` and
    ``(h / (h + 8)) / (128 / 136)``."""

    matrix: float = 0.6
    vector: float = 0.5
    memory: float = 0.8
    kernel_floor_s: float = 5e-6
    matrix_half_dim: float = 0.0  # 0: every product at ``matrix``
    attention_forward: float | None = None  # None: as ``matrix``
    attention_backward: float | None = None
    attention_half_seq: float = 0.0

    def __post_init__(self) -> None:
        for name in ("matrix", "vector", "memory", "attention_forward", "attention_backward"):
            value = getattr(self, name)
            if value is None:
                continue
            if not 0 < value <= 1:
                raise YafsdpError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.kernel_floor_s < 0:
            raise YafsdpError(f"kernel floor must be 0 or more seconds, got {self.kernel_floor_s}")
        for name in ("matrix_half_dim", "attention_half_seq"):
            if not 0 <= getattr(self, name) <= 1e6:
                raise YafsdpError(f"efficiency {name} must be 0 to 1e6, got {getattr(self, name)}")

    def product(self, dims: tuple[int, ...]) -> float:
        """A matrix product's efficiency from its (M, K, N); ``matrix`` without them."""
        if len(dims) != 3 or not self.matrix_half_dim:
            return self.matrix
        d = min(dims)
        return self.matrix * d / (d + self.matrix_half_dim)

    def attention(self, backward: bool, dims: tuple[int, ...]) -> float:
        """A flash attention kernel's efficiency from its (sequence, head dim, causal)."""
        base = self.attention_backward if backward else self.attention_forward
        if base is None:
            return self.product(())
        if len(dims) != 3:
            return base
        seq, head = dims[0], dims[1]
        by_seq = seq / (seq + self.attention_half_seq)
        by_head = (head / (head + HEAD_HALF)) / (128 / (128 + HEAD_HALF))
        return min(1.0, base * by_seq * by_head)


# the head dimension at which a flash kernel runs at half its long-head rate: the
# FlashAttention-2 paper's head-dim 64 runs are about 6% slower than its 128 ones
# (Dao 2023, figures 4-6), which h / (h + 8) reproduces (0.889 / 0.941)
HEAD_HALF = 8


def efficiency_for(gpu: GpuSpec) -> Efficiency:
    """The published efficiencies of ``gpu``'s row (``GPU_EFFICIENCY``), else the
    generic defaults."""
    found = GPU_EFFICIENCY.get(gpu.name.lower())
    return found if found is not None else Efficiency()


@dataclass(frozen=True, slots=True)
class PhaseTime:
    """A phase's time on one GPU, and how much of it each bound decided."""

    phase: str
    seconds: float
    kernels: int
    # ``BOUNDS`` -> seconds: each kernel's time above the floor under the bound that
    # decided it, and every kernel's floor under ``floor``; they sum to ``seconds``
    bound_s: dict[str, float]


def kernel_time(
    gpu: GpuSpec,
    eff: Efficiency,
    *,
    matrix_flops: float = 0,
    dtype: str = "bfloat16",
    vector_flops: float = 0,
    nbytes: float = 0,
    matrix_eff: float | None = None,
) -> tuple[float, str]:
    """(seconds, the bound that decided) for one kernel; ``matrix_eff``: its products'
    efficiency (default ``eff.matrix``)."""
    matrix_eff = eff.matrix if matrix_eff is None else matrix_eff
    times = {
        "matrix": matrix_flops / (gpu.matrix_peak(dtype) * matrix_eff),
        "vector": vector_flops / (gpu.fp32_flops * eff.vector),
        "memory": nbytes / (gpu.hbm_bytes_per_s * eff.memory),
    }
    bound = max(times, key=times.get)
    if times[bound] == 0:
        bound = "floor"
    return times.get(bound, 0.0) + eff.kernel_floor_s, bound


def op_time(op: OpCost, gpu: GpuSpec, eff: Efficiency) -> tuple[float, str]:
    return kernel_time(
        gpu,
        eff,
        matrix_flops=op.matrix_flops,
        dtype=op.dtype,
        vector_flops=op.vector_flops,
        nbytes=op.bytes,
        matrix_eff=matrix_efficiency(op, eff) if op.matrix_flops else None,
    )


def matrix_efficiency(op: OpCost, eff: Efficiency) -> float:
    """The efficiency of ``op``'s products: an attention kernel's own, forward or
    backward; a product's by its shape."""
    name = op.name.split(".")[1] if op.name.startswith("aten.") else op.name
    if "attention" in name:
        return eff.attention("backward" in name, op.dims)
    return eff.product(op.dims)


def _is_attention(op: OpCost) -> bool:
    return op.name.startswith("aten.") and "attention" in op.name.split(".")[1]


def phase_time(ops, phase: str, gpu: GpuSpec, eff: Efficiency | None = None) -> PhaseTime:
    """The sum of ``phase``'s kernels' times (``ops``: ``StepCosts.ops``)."""
    eff = eff or efficiency_for(gpu)
    seconds, kernels = 0.0, 0
    bound_s = dict.fromkeys(BOUNDS, 0.0)
    for op in ops:
        if op.phase != phase:
            continue
        t, bound = op_time(op, gpu, eff)
        seconds += t
        kernels += 1
        if bound == "matrix" and _is_attention(op):
            bound = "attention"
        bound_s[bound] += t - eff.kernel_floor_s
        bound_s["floor"] += eff.kernel_floor_s
    return PhaseTime(phase, seconds, kernels, bound_s)


# Each GPU's published efficiencies (docs/timing.md lists the sources):
# - ``matrix``: the maximum achievable matmul FLOPS (bf16, the best shape) over the
#   dense peak, from the MAMF table of Bekman's "Machine Learning Engineering"
#   (compute/accelerator/README.md): A100 SXM 271.2 of 312 (86.9%), H100 SXM 794.5 of
#   989 (80.3%), GH200 (the H200's chip and memory) 828.6 of 989 (83.8%), MI300X
#   781.9 of 1300 (60.1%);
# - ``matrix_half_dim`` 256: a product's smallest side at which it runs at half that
#   (cuBLAS's tiles are 128 to 256 wide; a side of a few tiles leaves waves of SMs
#   idle), so a 4096-wide product reaches 94% of the best shape and a 768-wide one 75%;
# - ``attention_*``: the flash kernels' share of the dense peak at head dimension 128
#   and a long sequence, causal, the masked half not counted. The standalone
#   FlashAttention-2 rates (Dao 2023, figures 4 and 7: about 200 forward and 170
#   backward TFLOP/s on an A100, 350 and 300 on an H100) over-predict the published
#   long-sequence training rows by up to 1.46x, so these are solved from two
#   published rows per GPU (MPT-1B at 2048 and 32768 tokens on A100 80GB and on H100,
#   llm-foundry's tables: the non-attention work at ``matrix``, attention at this
#   rate, both MFUs as published), split forward/backward in FlashAttention-2's 1.2
#   ratio; the H200 takes the H100's (the same chip). ``attention_half_seq`` 512: the
#   sequence at which a kernel runs at half that (both FlashAttention papers' rates at
#   512 tokens are about half of those at 16k). docs/timing.md says which rows check
#   them;
# - ``memory``: a streaming copy reaches 80-90% of the datasheet's HBM bandwidth.
_A100 = Efficiency(
    matrix=0.869, matrix_half_dim=256, attention_forward=0.354,
    attention_backward=0.295, attention_half_seq=512,
)  # fmt: skip
_H100 = Efficiency(
    matrix=0.803, matrix_half_dim=256, attention_forward=0.203,
    attention_backward=0.17, attention_half_seq=512,
)  # fmt: skip
_H200 = Efficiency(
    matrix=0.838, matrix_half_dim=256, attention_forward=0.203,
    attention_backward=0.17, attention_half_seq=512,
)  # fmt: skip
GPU_EFFICIENCY = {
    "a100-40gb": _A100,
    "a100-80gb": _A100,
    "h100-sxm": _H100,
    "h200": _H200,
    "mi300x": Efficiency(matrix=0.601, matrix_half_dim=256),
}
