"""Sizes on the command line (``80GiB``, ``512MiB``, ``80GB``) to bytes.

A size needs its unit: a bare ``80`` could mean bytes, GB or GiB, and reading it as
bytes turns a GPU into 80 bytes. Zero is the one number that needs none. KiB..TiB
(and K, M, G, T, as ``ls -h`` and Slurm's ``--mem`` write them) are powers of 1024;
KB..TB are SI, powers of 1000, which is what GPU vendors print on the box but not
what ``nvidia-smi`` or ``torch.cuda.mem_get_info`` report: ``80GB`` is 74.51 GiB.
So a size given in SI units is accepted and echoed with its GiB value
(``si_echo``), since a figure 7% off silently turns a fit into an OOM. A size is
finite and at most ``numbers.MAX_BYTES`` (1 EiB): ``1e400GiB`` is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError
from ..gpu_table import MIB, ROWS
from ..numbers import MAX_BYTES, shown

# the parts of the memory beside the caching allocator that ``--outside`` overrides,
# by the keyword ``memory.outside_allocator.outside_memory`` takes
OUTSIDE_PARTS = ("context", "cublas", "cublaslt", "nccl")

GiB = 1024**3
_BINARY = {
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}
_SI = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = {**_BINARY, **_SI}


def _split(text: str) -> tuple[str, str]:
    """``"80 GiB"`` -> ``("80", "gib")``."""
    s = text.strip().replace(" ", "").replace("_", "").lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    return number, s[len(number) :]


def parse_size(text: str, flag: str) -> int:
    """``"80GiB"`` -> bytes, for the option ``flag`` the user typed (named in errors).

    >>> parse_size("80GiB", "--gpu-memory") == 80 * 1024**3
    True
    """
    number, unit = _split(text)
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if value == 0 and not unit:
        return 0
    if 0 <= value <= MAX_BYTES and not unit:
        raise YafsdpError(f"{flag} {shown(text)}: a size needs a unit, e.g. {number}GiB")
    if unit not in _UNITS or not value >= 0:
        raise YafsdpError(
            f"{flag} {shown(text)!r} is not a size; write it like 80GiB, 2GiB or 512MiB"
        )
    size = value * _UNITS[unit]
    if not size <= MAX_BYTES:  # inf too: 1e400GiB
        raise YafsdpError(f"{flag} {shown(text)}: a size is at most 1 EiB (1024**6 bytes)")
    return int(size)


def is_si(text: str) -> bool:
    """Whether ``text`` is in KB/MB/GB/TB (powers of 1000)."""
    return _split(text)[1] in _SI


def si_echo(text: str, flag: str, size: int | None = None) -> str | None:
    """What a size in SI units is in GiB, or None for a size in binary units; ``size``:
    ``text`` already parsed."""
    if not is_si(text):
        return None
    size = parse_size(text, flag) if size is None else size
    unit = _split(text)[1].upper()
    return f"{flag} {text} is {size:,} bytes = {binary(size)} ({unit}: powers of 1000)"


@dataclass(frozen=True, slots=True)
class MemorySizes:
    """The memory piece's sizes as typed, each parsed once: bytes, and what a size in
    SI units really is (``notes``)."""

    gpu_memory: int | None
    reserve: int | None
    outside: tuple[tuple[str, int], ...]
    notes: tuple[str, ...]


def memory_sizes(
    *, gpu_memory: str | None, reserve: str | None, outside: str | None
) -> MemorySizes:
    """``--gpu-memory``, ``--reserve`` and ``--outside`` to bytes (None: not given);
    a reserve typed beside the GPU's memory is checked here, blaming the option typed
    (the itemised parts, without --reserve, once the GPU is known: ``plan``)."""
    gpu = parse_size(gpu_memory, "--gpu-memory") if gpu_memory else None
    held = None if reserve is None else parse_size(reserve, "--reserve")
    if gpu is not None and held is not None:
        check_reserve(gpu, held, reserve_typed=True)
    notes = list(gpu_memory_notes(gpu_memory, gpu)) if gpu_memory else []
    if reserve is not None:
        notes += filter(None, [si_echo(reserve, "--reserve", held)])
    return MemorySizes(gpu, held, parse_outside(outside), tuple(notes))


def gpu_memory_notes(text: str, size: int | None = None) -> tuple[str, ...]:
    """What ``--gpu-memory`` given in SI units (``80GB``) is in GiB and, where GPUs
    sold as that many GB are in ``gpu_table``, what they really hold: the box says
    "80 GB" of a GPU whose driver reports 81,559 MiB (79.65 GiB), so ``80GB``
    (74.51 GiB) understates it by 5 GiB, enough to turn a fit into an OOM. ``size``:
    ``text`` already parsed."""
    size = parse_size(text, "--gpu-memory") if size is None else size
    echo = si_echo(text, "--gpu-memory", size)
    if echo is None:
        return ()
    sold_as = size / 10**9  # the number on the box
    near: dict[int, str] = {}  # one name per figure: the H100 SXM and PCIe hold the same
    for name, memory_bytes, *_ in ROWS:
        if abs(memory_bytes / GiB - sold_as) <= 0.1 * sold_as:
            near.setdefault(memory_bytes, name)
    if not near:
        return (echo,)
    held = ", ".join(f"{name} {b // MIB:,} MiB ({b / GiB:.2f} GiB)" for b, name in near.items())
    first = min(near)
    hint = (
        f"GPUs sold as {sold_as:g} GB hold {held}; give what nvidia-smi reports, "
        f"e.g. --gpu-memory {first // MIB}MiB"
    )
    return (echo, hint)


def parse_outside(text: str | None) -> tuple[tuple[str, int], ...]:
    """``"context=1GiB,nccl=0"`` -> ``(("context", 1073741824), ("nccl", 0))``."""
    if not text:
        return ()
    pairs = []
    for item in text.replace(" ", "").split(","):
        part, _, size = item.partition("=")
        if part not in OUTSIDE_PARTS or not size:
            raise YafsdpError(
                f"--outside {item!r}: write PART=SIZE pairs separated by commas, PART one of "
                f"{', '.join(OUTSIDE_PARTS)}, e.g. context=1GiB,nccl=256MiB"
            )
        pairs.append((part, parse_size(size, f"--outside {part}")))
    return tuple(dict(pairs).items())


def parse_margin(text: str | None, gpu_memory: int) -> int | None:
    """``"5%"`` -> 5% of ``gpu_memory`` in bytes; ``"2GiB"`` -> bytes; None stays None."""
    if text is None:
        return None
    s = text.strip()
    if not s.endswith("%"):
        return parse_size(s, "--margin")
    try:
        share = float(s[:-1])
    except ValueError:
        share = -1.0
    if not 0 <= share < 100:
        raise YafsdpError(
            f"--margin {shown(text)!r}: a share is a number from 0 to 100 with %, e.g. 3%"
        )
    return round(share / 100 * gpu_memory)


def binary(size: int) -> str:
    """``80 * 10**9`` -> ``"74.51 GiB"``: the largest binary unit that is at least 1."""
    for unit, scale in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def check_reserve(gpu_memory: int, held: int, *, reserve_typed: bool) -> None:
    """What a rank holds beside the allocator (``held``) leaves room on the GPU; the
    error blames the option the user typed: --reserve when it was given, else
    --gpu-memory (too small for the itemised CUDA context and workspaces)."""
    if gpu_memory <= 0:
        raise YafsdpError(f"--gpu-memory must be positive, e.g. 80GiB; got {gpu_memory} bytes")
    if held < gpu_memory:
        return
    gpu, held_text = binary(gpu_memory), binary(held)
    if reserve_typed:
        raise YafsdpError(f"--reserve {held_text} must be below --gpu-memory ({gpu})")
    raise YafsdpError(
        f"--gpu-memory {gpu} leaves nothing beside the {held_text} a rank holds outside "
        "PyTorch's allocator (CUDA context, cuBLAS workspaces); give one GPU's memory, "
        "e.g. 80GiB, or set those parts with --outside"
    )
