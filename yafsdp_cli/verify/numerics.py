"""Both models of a verify run compute on the same footing, by construction.

An exact comparison means something only if the original and the converted model
run the same kernels with the same splits of work. Three settings decide that on a
CPU, and a process can change each between the two runs without any conversion bug:

- **The thread count.** Several CPU kernels sum per thread and then across threads
  (LayerNorm's backward sums each thread's rows of ``d_bias`` in its own buffer), so
  the last bit of a gradient depends on how many threads ran it. Measured on a
  2-layer GPT-2: every LayerNorm bias gradient differs between 1 and 2 threads
  (1.8e-7 max abs) while the logits are equal (``tests/verify/test_numerics.py``).
- **Dynamic thread adjustment.** With ``OMP_DYNAMIC=true`` the OpenMP runtime sizes
  each parallel team from the load average (GNU libgomp: the CPUs less the 15-minute
  load), so a team of 2 becomes 1 on a busy machine, and a load average that crosses
  the line between the original's run and the converted's changes the sums above.
  MKL's own ``MKL_DYNAMIC`` may likewise pick fewer threads than asked. Both are
  switched off for the run.
- **Deterministic algorithms.** Kernels that accumulate with atomics (inductor's
  scatter-add for an embedding's backward, several CUDA kernels) vary run to run;
  torch's deterministic mode takes their serial or ordered versions.

``pinned`` sets all three for the run and gives the caller's settings back after,
so a library caller's process is left as it was (MKL's dynamic flag excepted: it
cannot be read back, and ``torch.set_num_threads`` always leaves it off). Every rank
of a distributed run pins its own process the same way. What remains possible (a
kernel that is not reproducible even so) is caught by re-running the original before
a mismatch is reported (``single`` and ``dist``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True, slots=True)
class Pinned:
    """What a verify run pinned, for its report."""

    threads: int
    omp_dynamic_off: bool  # False where no OpenMP runtime could be reached
    mkl_dynamic_off: bool  # False where torch has no MKL
    deterministic: bool

    def describe(self) -> str:
        parts = [f"{self.threads} thread{'s' if self.threads != 1 else ''} for both models"]
        off = [n for n, done in (("OpenMP", self.omp_dynamic_off), ("MKL", self.mkl_dynamic_off))
               if done]  # fmt: skip
        if off:
            parts.append(f"{' and '.join(off)} dynamic thread adjustment off")
        if self.deterministic:
            parts.append("torch deterministic algorithms on")
        return "pinned: " + ", ".join(parts)


@cache
def _library(name: str) -> ctypes.CDLL | None:
    """A runtime library torch loaded, by its file in torch's lib folder (the same file
    is the same handle), else the process's global symbols."""
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if name in f]
    for path in [*candidates, None]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _symbol(libraries: tuple[str, ...], symbol: str):
    for name in libraries:
        lib = _library(name)
        fn = getattr(lib, symbol, None) if lib is not None else None
        if fn is not None:
            return fn
    return None


def omp_dynamic() -> bool | None:
    """OpenMP's dynamic-adjustment flag for this thread; None without an OpenMP runtime."""
    fn = _symbol(("gomp", "iomp"), "omp_get_dynamic")
    return None if fn is None else bool(fn())


def set_omp_dynamic(on: bool) -> bool:
    fn = _symbol(("gomp", "iomp"), "omp_set_dynamic")
    if fn is None:
        return False
    fn(ctypes.c_int(int(on)))
    return True


def _mkl_dynamic_off() -> bool:
    # MKL's C entry point takes the flag by value; the lower-case ``mkl_set_dynamic``
    # symbol is its Fortran interface, which takes a pointer
    fn = _symbol(("torch_cpu",), "MKL_Set_Dynamic") if torch.backends.mkl.is_available() else None
    if fn is None:
        return False
    fn(ctypes.c_int(0))
    return True


def apply(threads: int) -> Pinned:
    """Pin this process now (also between the two models' runs: whatever ran in
    between, the converted model starts on the same settings as the original)."""
    # cuBLAS is deterministic only with a fixed workspace; read when its handle is made
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    omp = set_omp_dynamic(False)
    mkl = _mkl_dynamic_off()
    torch.use_deterministic_algorithms(True, warn_only=True)
    return Pinned(threads, omp, mkl, deterministic=True)


@contextmanager
def pinned(threads: int | None = None) -> Iterator[Pinned]:
    """Pin threads (default: torch's current count), dynamic adjustment and
    deterministic algorithms for the block; the caller's settings back after."""
    before = (
        torch.get_num_threads(),
        omp_dynamic(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        yield apply(threads or before[0])
    finally:
        torch.set_num_threads(before[0])
        if before[1] is not None:
            set_omp_dynamic(before[1])
        torch.use_deterministic_algorithms(before[2], warn_only=before[3])
