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

from ..errors import YafsdpError
from ..numbers import MAX_BYTES, shown

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


def si_echo(text: str, flag: str) -> str | None:
    """What a size in SI units is in GiB, or None for a size in binary units."""
    if not is_si(text):
        return None
    size = parse_size(text, flag)
    unit = _split(text)[1].upper()
    return f"{flag} {text} is {size:,} bytes = {binary(size)} ({unit}: powers of 1000)"


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
