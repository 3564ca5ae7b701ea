"""Every number a user gives, checked in one place: finite and in range.

Numbers reach yafsdp from the command line, a GPU profile, a baseline file and an
allocator setting. Python reads ``nan``, ``inf`` and ``1e400`` as floats (its
``json`` reads ``NaN``, ``Infinity`` and ``1e400`` too) and lets an integer grow
without bound, so an unchecked number either passes every ``x < low`` test (NaN
compares false with everything) or makes a product overflow (``int(inf)``) far
from where it was read. ``checked`` is the one test every reader applies, and its
message names the option or the file and field.

The upper bounds are physical, each far above any machine that exists, so that no
product of them overflows what is computed with them (int64 tensor sizes, floats):

- ``MAX_BYTES``, 1 EiB: a size per GPU (memory, what is held beside the allocator,
  a margin, an allocator setting); the largest GPU holds under 2**38 bytes;
- ``MAX_COUNT``, 2**20: ranks, micro-batches, samples, steps, rows; with
  ``MAX_SEQ_LEN`` (2**24 tokens per sample) a micro-batch holds at most 2**44
  tokens, and 2**44 tokens times a hidden size of 2**16 in float32 fit in int64;
- ``MAX_FLOPS``, 1e18 FLOP/s (a GPU of 2025 does about 1e15 dense bf16), and
  ``MAX_BYTES_PER_S``, 1e15 bytes/s (HBM3e: about 5e12): the rates of a GPU profile
  and ``--network``; at least ``MIN_RATE``, a thousand per second, since a time is
  a count divided by a rate and ``1e-300`` would make it infinite;
- ``MAX_TOKENS``, 1e18: tokens to train on (about 1e14 for the largest runs);
- ``MAX_GRAD_ACCUM``, 1024 micro-batches accumulated per optimizer step: the fake
  step writes every micro-batch's events, so what it costs grows with them, and a
  global batch of the largest runs takes a few hundred micro-batches per rank at most.
"""

from __future__ import annotations

import math

from .errors import YafsdpError, printable

MAX_BYTES = 1 << 60
MAX_COUNT = 1 << 20
MAX_GRAD_ACCUM = 1 << 10
MAX_SEQ_LEN = 1 << 24
MAX_FLOPS = 1e18
MAX_BYTES_PER_S = 1e15
MIN_RATE = 1e3  # FLOP/s or bytes/s
MIN_EFFICIENCY = 1e-12  # a fraction of a peak kernels reach (a calibration on a CPU: ~1e-8)
MAX_TOKENS = 10**18
MAX_SEED = 2**63 - 1  # what torch.manual_seed takes
MAX_JOBS = 1024  # processes plan runs at once
MAX_ROUND_BYTES = 1 << 30  # allocator rounding (CUDA's: 512 bytes)
MAX_PERCENT = 1e6  # a growth a gate allows, in percent
MAX_TOLERANCE = 1e30  # verify's absolute and relative tolerances
SHOWN = 40  # characters of an offending value a message repeats


def shown(value) -> str:
    """``value`` as a message repeats it: at most ``SHOWN`` characters, and an integer
    of thousands of digits by its length (Python refuses to print one above 4300)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"{'-' if value < 0 else ''}a number of about {digits} digits"
    text = value if isinstance(value, str) else repr(value)
    text = printable(text)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def _range(low, high, *, whole: bool, above: bool) -> str:
    if whole:
        return f"a whole number from {low:,} to {high:,}"
    if above:
        return f"a finite number above {low:g} up to {high:g}"
    return f"a finite number from {low:g} to {high:g}"


def problem(
    value, low, high, *, whole: bool = False, above: bool = False, typed: str | None = None
) -> str | None:
    """What is wrong with ``value`` as a number in [``low``, ``high``] (``above``:
    (low, high]; ``whole``: an integer), or None when nothing is; the message repeats
    ``typed`` (what the user wrote: ``1e400``, not ``inf``) where given."""
    got = shown(value if typed is None else typed)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    finite = number and (isinstance(value, int) or math.isfinite(value))
    if not finite or (whole and isinstance(value, float) and not value.is_integer()):
        return f"must be {_range(low, high, whole=whole, above=above)}, got {got}"
    if above and value <= low:
        return f"must be {'positive' if low == 0 else f'above {low:,}'}, got {got}"
    if value < low:
        return f"must be {'0 or more' if low == 0 else f'at least {low:,}'}, got {got}"
    if value > high:
        return f"must be at most {high:,}, got {got}"
    return None


def checked(value, name: str, low, high, *, whole: bool = False, above: bool = False, typed=None):
    """``value`` when it is a finite number in range (an ``int`` when ``whole``), else
    ``YafsdpError`` naming ``name`` (an option, or a file and its field)."""
    wrong = problem(value, low, high, whole=whole, above=above, typed=typed)
    if wrong is not None:
        raise YafsdpError(f"{name} {wrong}")
    return int(value) if whole else value


def from_text(text: str, *, whole: bool = False) -> int | float | str:
    """A number written on the command line, or ``text`` itself when it is none (for
    ``problem`` to refuse): whole numbers as digits, others as Python floats
    (``nan``, ``inf`` and ``1e400`` included, which ``problem`` refuses)."""
    s = text.strip().replace("_", "")
    try:
        return int(s)
    except ValueError:  # not digits, or more digits than Python converts
        pass
    if whole and not any(c in s.lower() for c in ".en"):
        return text
    try:
        return float(s)
    except ValueError:
        return text
