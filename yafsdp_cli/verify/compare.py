"""Comparing the converted model's tensors with the original's, for ``verify``.

A tensor passes when ``|converted - original| <= atol + rtol * |original|`` everywhere
(NaNs in the same places); ``Recorder`` keeps each tensor's worst comparison over
all steps and the first failure in run order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..engine import dtypes

KINDS = ("output", "gradient", "parameter", "buffer")
CHUNK = 1 << 22  # elements compared at once
CUDA_TOLERANCE = {"float32": (1e-5, 1.3e-6), "bfloat16": (1e-5, 1.6e-2), "float16": (1e-5, 1e-3)}


@dataclass(frozen=True, slots=True)
class Tolerance:
    dtype: str
    atol: float
    rtol: float


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """The worst disagreement of one tensor over all steps."""

    kind: str  # output | gradient | parameter | buffer
    name: str
    step: int  # the step of the worst disagreement, from 0
    dtype: str
    max_abs: float  # max |converted - original|
    max_rel: float  # max of that / |original| (inf where the original is 0)
    ok: bool
    problem: str = ""  # a mismatch that is not numeric: shape, dtype, missing, None


def resolve_tolerances(device: str, atol: float | None, rtol: float | None) -> dict:
    """dtype -> Tolerance (a dtype not listed is compared exactly unless overridden)."""
    out = {}
    for dtype in ("float64", "float32", "bfloat16", "float16"):
        base_atol, base_rtol = CUDA_TOLERANCE.get(dtype, (0.0, 0.0)) if device == "cuda" else (0, 0)
        out[dtype] = Tolerance(
            dtype,
            float(base_atol if atol is None else atol),
            float(base_rtol if rtol is None else rtol),
        )
    return out


def _tolerance(tols: Mapping[str, Tolerance], dtype: str) -> Tolerance:
    return tols.get(dtype) or Tolerance(dtype, 0.0, 0.0)


def diff_tensors(kind, name, step, got, want, tols) -> TensorDiff:
    """Compare ``got`` (converted) with ``want`` (original)."""
    if got is None and want is None:
        return TensorDiff(kind, name, step, "", 0.0, 0.0, True)
    if got is None or want is None:
        tensor = got if want is None else want
        dtype = dtypes.from_torch(tensor.dtype)
        if kind == "gradient" and want is None and not got.any():
            return TensorDiff(kind, name, step, dtype, 0.0, 0.0, True, "no gradient; zeros")
        which = "converted" if got is None else "original"
        return TensorDiff(kind, name, step, dtype, math.inf, math.inf, False, f"None in {which}")
    dtype = dtypes.from_torch(want.dtype)
    if got.shape != want.shape or got.dtype != want.dtype:
        problem = f"{tuple(got.shape)} {got.dtype} vs original {tuple(want.shape)} {want.dtype}"
        return TensorDiff(kind, name, step, dtype, math.inf, math.inf, False, problem)
    if not want.is_floating_point():
        same = torch.equal(got, want)
        return TensorDiff(kind, name, step, dtype, 0.0 if same else math.inf, 0.0, same)
    return _numeric_diff(kind, name, step, got, want, _tolerance(tols, dtype))


def _numeric_diff(kind, name, step, got, want, tol: Tolerance) -> TensorDiff:
    got, want = got.detach(), want.detach()
    if torch.equal(got, want):  # the usual case; no temporaries
        return TensorDiff(kind, name, step, tol.dtype, 0.0, 0.0, True)
    # in pieces, so a 500 MB embedding costs a few 32 MB temporaries, not five copies
    a_all, b_all = got.reshape(-1), want.reshape(-1)
    max_abs = max_rel = 0.0
    ok = True
    for start in range(0, a_all.numel(), CHUNK):
        a = a_all[start : start + CHUNK].double()
        b = b_all[start : start + CHUNK].double()
        same = (a == b) | (a.isnan() & b.isnan())
        err = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=math.inf))
        scale = b.abs()
        rel = torch.where(err == 0, torch.zeros_like(err), err / scale)
        ok &= bool((err <= tol.atol + tol.rtol * scale.nan_to_num(nan=0.0)).all())
        max_abs, max_rel = max(max_abs, err.max().item()), max(max_rel, rel.max().item())
    return TensorDiff(kind, name, step, tol.dtype, max_abs, max_rel, ok)


class Recorder:
    """Keeps each tensor's worst comparison over all steps."""

    def __init__(self, tolerances: Mapping[str, Tolerance]):
        self.tolerances = tolerances
        self.worst: dict[tuple[str, str], TensorDiff] = {}
        self.compared = self.failures = 0
        self.no_grad_zero: set[str] = set()
        self.first_failure: TensorDiff | None = None  # in run order

    def add(self, d: TensorDiff) -> None:
        self.compared += 1
        self.failures += not d.ok
        if not d.ok and self.first_failure is None:
            self.first_failure = d
        if d.problem == "no gradient; zeros":
            self.no_grad_zero.add(d.name)
        key = (d.kind, d.name)
        old = self.worst.get(key)
        if old is None or _rank_key(d) < _rank_key(old):
            self.worst[key] = d

    def compare(self, kind, name, step, got, want) -> None:
        self.add(diff_tensors(kind, name, step, got, want, self.tolerances))

    def compare_all(self, kind, step, got: Mapping, want: Mapping) -> None:
        for name in sorted(set(got) | set(want)):
            if name not in got or name not in want:
                side = "converted" if name not in got else "original"
                problem = f"missing in the {side} model"
                self.add(TensorDiff(kind, name, step, "", math.inf, math.inf, False, problem))
            else:
                self.compare(kind, name, step, got[name], want[name])

    def merge(self, other: Recorder) -> None:
        self.compared += other.compared
        self.failures += other.failures
        self.no_grad_zero |= other.no_grad_zero
        firsts = [d for d in (self.first_failure, other.first_failure) if d is not None]
        self.first_failure = min(firsts, key=_run_order, default=None)
        for key, d in other.worst.items():
            old = self.worst.get(key)
            if old is None or _rank_key(d) < _rank_key(old):
                self.worst[key] = d

    def ranked(self, top: int) -> tuple[TensorDiff, ...]:
        return tuple(sorted(self.worst.values(), key=_rank_key)[:top])


def _run_order(d: TensorDiff):
    return (d.step, KINDS.index(d.kind), d.name)


def _rank_key(d: TensorDiff):
    return (d.ok, -d.max_abs, -d.max_rel, d.kind, d.name)
