"""``yafsdp calibrate``'s library half: measure a device into a GPU profile.

Three measurements on the device, and one real training step:

- matrix products at the model's own training shapes: for every linear layer of
  weight ``(out, in)`` at ``T`` tokens per step, the forward ``(T, in) x (in, out)``,
  the input's gradient ``(T, out) x (out, in)`` and the weight's ``(out, T) x (T, in)``,
  each distinct shape timed once and weighted by how many layers have it; the
  achieved FLOP/s over the datasheet's peak is the ``matrix`` efficiency;
- HBM bandwidth: a large copy (``dst.copy_(src)`` reads and writes each byte once),
  over the datasheet's bandwidth, is the ``memory`` efficiency;
- the least an op costs: a run of tiny adds, each launched and dispatched by eager
  PyTorch (recorded; the kernel floor comes from the step, below);
- one real training step of the model (the step ``timing.count_step`` counts: the same
  batch, loss, optimizer and checkpointing), the median of ``steps`` after ``warmup``.

The step's prediction with the measured matrix and memory efficiencies and no floor
is ``R``; the step has ``N`` kernels, each with the same floor, so the floor that
makes the prediction equal the measured step is ``(measured - R) / N`` (0 where the
roofline alone already takes longer: the floor cannot be negative). That floor
carries what the roofline does not see in an eager step: launches, the host's
dispatch, the gaps between kernels.

Every function takes the device, so the arithmetic and the file run on a CPU in the
tests; ``yafsdp calibrate`` runs them on CUDA only.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..engine import dtypes
from ..engine.idioms import apply_checkpointing
from ..engine.losses import loss_for
from ..engine.module_spec import spec_from_module
from ..engine.plan import plan
from ..engine.train_step import make_batch, make_optimizer, run_forward
from ..errors import YafsdpError
from ..gpu_table import DEVICE_NAMES
from ..options import LayoutOptions
from ..profiling.precision import Masters, cast_params
from ..profiling.profile_options import ProfileOptions
from .gpu_profile import GpuProfile
from .gpu_specs import GPUS, GpuSpec, gpu_spec
from .roofline import Efficiency
from .step_costs import count_step
from .step_estimate import estimate_step

COPY_BYTES = 1 << 30  # far beyond any cache: what HBM streams


@dataclass(frozen=True, slots=True)
class MatmulRate:
    m: int
    k: int
    n: int
    count: int  # products of this shape in one step
    seconds: float  # one product

    @property
    def flops_per_s(self) -> float:
        return 2 * self.m * self.k * self.n / self.seconds


@dataclass(frozen=True, slots=True)
class Measured:
    """What ``measure`` found on the device, and the profile it makes."""

    matmuls: tuple[MatmulRate, ...]
    hbm_bytes_per_s: float
    tiny_op_s: float
    step_s: float  # the median real step
    predicted_s: float  # the calibrated profile's prediction of that step
    datasheet_s: float  # the prediction on the datasheet's figures, default efficiencies
    kernels: int
    profile: GpuProfile


def table_gpu(device_name: str) -> GpuSpec:
    """The table's row of a CUDA device called ``device_name`` (``torch.cuda.get_device_name``)."""
    for key, row in DEVICE_NAMES:
        if key.lower() in device_name.lower():
            return gpu_spec(row)
    known = ", ".join(g.name for g in GPUS.values())
    raise YafsdpError(
        f"{device_name!r} is not in the GPU table; give --gpu NAME, the row whose datasheet "
        f"figures the efficiencies are taken over ({known})"
    )


def training_matmuls(module: nn.Module, tokens: int) -> Counter[tuple[int, int, int]]:
    """(m, k, n) -> how many products of that shape a step of ``tokens`` runs."""
    shapes: Counter[tuple[int, int, int]] = Counter()
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        if isinstance(m, nn.Linear):
            out, inp = weight.shape
        elif type(m).__name__ == "Conv1D":  # GPT-2's transposed linear
            inp, out = weight.shape
        else:
            continue
        shapes[(tokens, inp, out)] += 1  # forward
        shapes[(tokens, out, inp)] += 1  # the input's gradient
        shapes[(out, tokens, inp)] += 1  # the weight's gradient
    return shapes


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeat: int, warmup: int = 2) -> float:
    """Seconds per call of ``fn``, ``repeat`` calls between two synchronisations."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeat


def time_matmul(device, m: int, k: int, n: int, dtype: torch.dtype, repeat: int = 10) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((m, k), device=device, dtype=dtype, generator=g)  # (m, k)
    b = torch.randn((k, n), device=device, dtype=dtype, generator=g)  # (k, n)
    out = torch.empty((m, n), device=device, dtype=dtype)
    return _timed(lambda: torch.mm(a, b, out=out), device, repeat)


def attention_seconds(
    device, sequences: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, repeat: int = 5
) -> tuple[float, float]:
    """(forward, backward) seconds of causal ``scaled_dot_product_attention`` at the
    model's shape, the kernel the fake step counts."""
    g = torch.Generator(device=device).manual_seed(0)
    shape = (sequences, heads, seq, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, generator=g).requires_grad_()
        for _ in range(3)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sdpa(q, k, v, is_causal=True)
    grad = torch.ones_like(out)
    forward = _timed(lambda: sdpa(q, k, v, is_causal=True), device, repeat)

    def both():
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)

    return forward, max(_timed(both, device, repeat) - forward, 1e-12)


def attention_shape(module: nn.Module) -> tuple[int, int] | None:
    """(heads, head dim) from a transformers config; None where it has none."""
    cfg = getattr(module, "config", None)
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    width = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not heads or not width:
        return None
    return heads, getattr(cfg, "head_dim", None) or width // heads


def hbm_bandwidth(device, nbytes: int = COPY_BYTES, repeat: int = 10) -> float:
    """Bytes/s of a copy: each byte read once and written once."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, repeat)


def tiny_op_seconds(device, repeat: int = 1000) -> float:
    x = torch.zeros(1, device=device)
    return _timed(lambda: x.add_(1), device, repeat)


def real_step_seconds(module: nn.Module, opts: ProfileOptions, warmup: int, steps: int) -> float:
    """The median of ``steps`` real training steps of ``module`` (on its device, in
    ``opts.step.param_dtype``) after ``warmup``, as ``count_step`` counts one."""
    device = next(module.parameters()).device
    cast_params(module, opts.step.param_dtype)
    module.train()
    units = plan(spec_from_module(module), LayoutOptions(units=opts.layout.units)).blocks
    apply_checkpointing(module, opts.step.checkpointing, units)
    loss_of = loss_for(module, opts.step)
    batch = loss_of.batch(make_batch(module, opts.step))
    params = list(module.parameters())
    masters = Masters(module, params, opts.step.grad_dtype) if opts.step.param_dtype else None
    opt = make_optimizer(
        opts.step.optimizer, masters.stepped if masters else params, opts.step.optimizer_impl
    )
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        with loss_of.running():
            loss_of(run_forward(module, batch)).backward()
        if masters is not None:
            masters.after_backward()
            masters.before_step()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if masters is not None:
            masters.after_step()
        for p in params:
            p.grad = None
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    loaded,
    opts: ProfileOptions,
    device: str | torch.device,
    base: GpuSpec,
    *,
    warmup: int = 3,
    steps: int = 10,
    repeat: int = 10,
    copy_bytes: int = COPY_BYTES,
) -> Measured:
    """Measure ``device`` with ``loaded``'s model (``sources.load_source``'s result) at
    ``opts``'s step into a profile over ``base``'s datasheet figures."""
    device = torch.device(device)
    module = loaded.build_module().to(device)
    dtype_name = dtypes.canonical(opts.step.param_dtype) if opts.step.param_dtype else "float32"
    dtype = getattr(torch, dtype_name)
    shapes = training_matmuls(module, opts.step.batch * opts.step.seq_len)
    if not shapes:
        raise YafsdpError("the model has no linear layers: no training shapes to time")
    matmuls = tuple(
        MatmulRate(m, k, n, count, time_matmul(device, m, k, n, dtype, repeat))
        for (m, k, n), count in shapes.items()
    )
    hbm = hbm_bandwidth(device, copy_bytes, repeat)
    tiny = tiny_op_seconds(device)
    attention = attention_shape(module)
    if attention is not None:
        heads, head_dim = attention
        b, t = opts.step.batch, opts.step.seq_len
        fwd_s, bwd_s = attention_seconds(device, b, heads, t, head_dim, dtype, repeat)
        # the kernels' FLOPs as the fake step counts them: causal, half the square;
        # backward 2.5 forwards (the recomputed scores and four gradients)
        fwd_flops = 2 * b * heads * t * t * head_dim
        attention = (fwd_flops / fwd_s, 2.5 * fwd_flops / bwd_s)
    step_s = real_step_seconds(module, opts, warmup, steps)
    del module
    costs = count_step(loaded, dataclasses.replace(opts, fake=True))
    flops = sum(2 * r.m * r.k * r.n * r.count for r in matmuls)
    achieved = flops / sum(r.seconds * r.count for r in matmuls)
    # measured at the model's own shapes and sequence: no shape factors on top
    peak = base.matrix_peak(dtype_name)
    eff = Efficiency(
        matrix=_fraction(achieved / peak),
        memory=_fraction(hbm / base.hbm_bytes_per_s),
        kernel_floor_s=0.0,
        attention_forward=_fraction(attention[0] / peak) if attention else None,
        attention_backward=_fraction(attention[1] / peak) if attention else None,
    )
    layout = plan(loaded.spec)  # one rank: no collectives, the whole optimizer step
    bare = estimate_step(costs, layout, base, eff=eff)
    kernels = sum(p.kernels for p in costs.phases)
    floor = max(0.0, (step_s - bare.step_s) / kernels) if kernels else 0.0
    eff = dataclasses.replace(eff, kernel_floor_s=floor)
    predicted = estimate_step(costs, layout, base, eff=eff).step_s
    datasheet = estimate_step(costs, layout, base).step_s  # the default efficiencies
    record = _record(device, matmuls, hbm, tiny, opts)
    if attention:
        record["attention_tflops"] = {
            "forward": attention[0] / 1e12,
            "backward": attention[1] / 1e12,
        }
    record["step"].update(measured_s=step_s, predicted_s=predicted, datasheet_s=datasheet)
    profile = GpuProfile(_measured_gpu(base, device, record), eff, record)
    return Measured(matmuls, hbm, tiny, step_s, predicted, datasheet, kernels, profile)


def _measured_gpu(base: GpuSpec, device: torch.device, record: dict) -> GpuSpec:
    """``base``'s datasheet figures, the device's own memory, and where they come from."""
    memory = base.memory_bytes
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    source = (
        f"{base.source}; efficiencies measured by yafsdp calibrate on {record['device']} "
        f"({record['date']})"
    )
    return dataclasses.replace(
        base, name=f"{base.name}-calibrated", memory_bytes=memory, source=source
    )


def _fraction(x: float) -> float:
    """An efficiency in (0, 1]: a device may beat its datasheet (boost clocks)."""
    return min(1.0, max(x, 1e-9))


def _record(device, matmuls, hbm, tiny, opts: ProfileOptions) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "step": {
            "batch": opts.step.batch,
            "seq_len": opts.step.seq_len,
            "param_dtype": opts.step.param_dtype,
            "optimizer": f"{opts.step.optimizer} ({opts.step.optimizer_impl})",
            "checkpointing": opts.step.checkpointing,
        },
        "matmuls": [
            {"m": r.m, "k": r.k, "n": r.n, "count": r.count, "tflops": r.flops_per_s / 1e12}
            for r in matmuls
        ],
        "hbm_gbps": hbm / 1e9,
        "tiny_op_us": tiny * 1e6,
    }
