"""Will ``verify`` fit? Its own peak, estimated before anything is allocated, against
the memory this process may use.

The run keeps one model alive at a time (``single``), so its peak is one model's
training state plus what a step makes on top of it:

- state: ``estimate_memory(layout).flat`` at world size 1, master weights off:
  parameters, gradients, optimizer states and module buffers of the converted model
  (the original's are the same bytes less the flat buffers' padding); in one
  process the optimizer state lies on disk but for one parameter's at a time
  (``offload``): the largest flat buffer's (or kept parameter's) share of it;
- activations: a forward of the meta-device architecture on the run's batch shape,
  the bytes of every leaf module's outputs (what autograd saves, roughly) times
  ``ACTIVATION_FACTOR`` for what the modules save inside, plus the loss's float32
  projection of the output; nothing is allocated;
- temporaries: ``TEMPORARY_FACTOR`` times the largest flat buffer (the conversion
  copies one buffer at a time; the for-loop optimizer makes whole-tensor
  temporaries of that size);
- ``MARGIN_BYTES`` for the allocator and the reference tensors read back from disk.

With N ranks the ranks run at once, and each holds the original whole beside its
shards (``dist``): N times two models' state.

The memory this process may use is the least of: the cgroup's limit less its use
(v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/
``memory.usage_in_bytes``; reclaimable page cache counted as free), ``RLIMIT_AS``
less the address space in use, and the kernel's ``MemAvailable``.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..engine import dtypes
from ..engine.layout import Layout
from ..engine.train_step import output_tensor
from ..memory.estimate import MemoryConfig, estimate_memory
from ..memory.headroom import fit, process_sum

ACTIVATION_FACTOR = 2
TEMPORARY_FACTOR = 3
MARGIN_BYTES = 256 * 2**20
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class PeakEstimate:
    """Bytes ``verify`` expects to allocate on top of what the process holds now."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int  # -1: could not be estimated (counted as 0)
    temporaries: int
    ranks: int = 1  # processes that each need all of the above at once
    models: int = 1  # models alive at once in each
    optimizer_at_once: int = -1  # optimizer state in memory at once; -1: all of it

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def resident_optimizer(self) -> int:
        return self.optimizer if self.optimizer_at_once < 0 else self.optimizer_at_once

    @property
    def resident_state(self) -> int:
        """The state in memory at once: all but the optimizer's on-disk part."""
        return self.state - self.optimizer + self.resident_optimizer

    @property
    def total(self) -> int:
        per_rank = self.models * self.resident_state + max(self.activations, 0)
        return process_sum(per_rank + self.temporaries, self.ranks, MARGIN_BYTES)


@dataclass(frozen=True, slots=True)
class Available:
    bytes: int
    source: str  # "MemAvailable", "cgroup memory.max", "RLIMIT_AS"


@dataclass(frozen=True, slots=True)
class Budget:
    """The estimate beside what is available, as the run's header and report give it."""

    estimate: PeakEstimate
    available: Available
    process_bytes: int  # this process's RSS when the estimate was made

    @property
    def fits(self) -> bool:
        return fit(self.estimate.total, 0, self.available.bytes, 0).fits


# -- what is available -------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_available(root: Path = CGROUP) -> int | None:
    """The cgroup's limit less its use (inactive page cache counts as free); None
    when there is no limit."""
    limit, used = _read_int(root / "memory.max"), _read_int(root / "memory.current")
    cache = _stat_value(root / "memory.stat", "inactive_file")
    if limit is None:  # cgroup v1, or "max"
        v1 = root / "memory"
        limit, used = (
            _read_int(v1 / "memory.limit_in_bytes"),
            _read_int(v1 / "memory.usage_in_bytes"),
        )
        cache = _stat_value(v1 / "memory.stat", "total_inactive_file")
        if limit is not None and limit >= 2**60:  # v1 writes "no limit" as a huge number
            limit = None
    if limit is None or used is None:
        return None
    return max(0, limit - used + cache)


def _kib_line(path: str, key: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def address_space_available() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(0, soft - 1024 * _kib_line("/proc/self/status", "VmSize"))


def mem_available() -> int | None:
    kib = _kib_line("/proc/meminfo", "MemAvailable")
    return 1024 * kib if kib else None


READERS: tuple[tuple[str, Callable[[], int | None]], ...] = (
    ("cgroup memory limit", cgroup_available),
    ("RLIMIT_AS", address_space_available),
    ("MemAvailable", mem_available),
)


def available_memory() -> Available:
    """The least of every limit that applies (see the module docstring)."""
    found = [(value, name) for name, read in READERS if (value := read()) is not None]
    if not found:
        return Available(2**62, "no limit found")
    value, name = min(found)
    return Available(value, name)


def release_freed() -> None:
    """Hand memory the process freed back to the system (glibc's ``malloc_trim``).

    Tensors below glibc's mmap threshold (which grows to 32 MiB as large blocks are
    freed) live in the heap; when the original model's optimizer state and gradients
    are freed, their pages stay resident until trimmed, and the converted model's
    flat buffers (large blocks, mapped afresh) would come on top of them. Not glibc:
    nothing to do."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def process_rss() -> int:
    return 1024 * _kib_line("/proc/self/status", "VmRSS")


def peak_rss(children: bool = False) -> int:
    """The most resident memory this process (or, with ``children``, the largest of its
    finished child processes) has held, in bytes (Linux reports KiB)."""
    who = resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF
    return 1024 * resource.getrusage(who).ru_maxrss


# -- what verify needs -------------------------------------------------------------


def estimate_peak(
    layout: Layout,
    optimizer: str,
    activations: int,
    *,
    ranks: int = 1,
    models: int = 1,
    offloaded: bool = False,
) -> PeakEstimate:
    """The run's peak above the process's current memory (see the module docstring);
    ``layout`` is planned at world size 1 (each rank holds the original whole).
    ``offloaded``: the optimizer state is on disk but for the largest parameter's."""
    flat = estimate_memory(layout, MemoryConfig(optimizer=optimizer, master_weights=False)).flat
    largest = max((b.padded_numel * dtypes.itemsize(b.dtype) for b in layout.buffers), default=0)
    at_once = -1
    if offloaded:
        kept = (t.numel * dtypes.itemsize(t.dtype) for t in layout.kept if t.is_param)
        slot = max(largest, *kept, 0)
        # torch's optimizers keep their states in the parameter's dtype: states per byte
        at_once = flat.optimizer * slot // flat.params if flat.params else 0
    return PeakEstimate(
        params=flat.params,
        grads=flat.grads,
        optimizer=flat.optimizer,
        buffers=flat.buffers,
        activations=activations,
        temporaries=TEMPORARY_FACTOR * largest,
        ranks=ranks,
        models=models,
        optimizer_at_once=at_once,
    )


def estimate_activations(meta_module: nn.Module, batch) -> int:
    """Bytes of every leaf module's outputs in one forward of ``meta_module`` (on the
    meta device: nothing is allocated) times ``ACTIVATION_FACTOR``, plus the loss's
    float32 projection of the output; -1 when the meta forward fails."""
    total = 0

    def count(_mod, _inputs, out) -> None:
        nonlocal total
        for t in _tensors(out):
            total += t.numel() * t.element_size()

    leaves = [m for m in meta_module.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            out = output_tensor(meta_module(*batch.args, **batch.kwargs))
    except Exception:  # noqa: BLE001 - some models cannot run on meta; say "unknown"
        return -1
    finally:
        for h in handles:
            h.remove()
    return ACTIVATION_FACTOR * total + 3 * out.numel() * 4


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
