"""The training schemes ``plan --scheme``, inspect's memory table and the step-time
model compare: one object per scheme, one module each (``flat_scheme``,
``fsdp2_scheme``, ``zero_scheme``, ``ddp_scheme``), and the one registry of them,
``SCHEMES``.

Each scheme knows its name (the command line's spelling), its label, what a rank
holds of parameters, gradients and optimizer states, its memory and its peak per
phase (composed from the memory model's parts), its collectives, and the keys two
JSON documents spell it by (``inspect_key``, ``timing_key``). Elsewhere schemes are
compared as objects, never by a string; the strings live here, on the command line
and where JSON is written or read (``tests/schemes/test_registry.py``).

This room imports only ``errors``; memory, timing, planning, inspection, the gate,
report and the command line import it. Adding a scheme: docs/design.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import YafsdpError
from .base import SHARDED, WHOLE, Collectives, Holds, Scheme, short_count
from .ddp_scheme import DDP
from .flat_scheme import FLAT
from .fsdp2_scheme import FSDP2
from .zero_scheme import ZERO1, ZERO2, ZERO3

# the registry: every scheme, in the order tables and documents list them
SCHEMES: tuple[Scheme, ...] = (FLAT, FSDP2, ZERO1, ZERO2, ZERO3, DDP)
NAMES = tuple(s.name for s in SCHEMES)

__all__ = [
    "DDP",
    "FLAT",
    "FSDP2",
    "NAMES",
    "SCHEMES",
    "SHARDED",
    "WHOLE",
    "ZERO1",
    "ZERO2",
    "ZERO3",
    "Collectives",
    "Holds",
    "Scheme",
    "by_name",
    "check_names",
    "parse",
    "short_count",
    "timed",
]


def by_name(name: str) -> Scheme:
    """The scheme the command line calls ``name``."""
    for s in SCHEMES:
        if s.name == name:
            return s
    raise YafsdpError(f"unknown scheme {name!r}; one of {', '.join(NAMES)}")


def parse(given: str | Sequence[str]) -> tuple[Scheme, ...]:
    """``"fsdp2"``, ``("zero3", "flat")`` or ``"all"`` -> schemes in registry order,
    ``flat`` always among them; an unknown name raises."""
    parts = given.split(",") if isinstance(given, str) else given
    names = [s.strip().lower() for s in parts if s.strip()]
    text = ",".join(names)
    if names == ["all"]:
        return SCHEMES
    bad = [s for s in names if s not in NAMES]
    if bad or not names:
        raise YafsdpError(
            f"--scheme {text!r}: unknown scheme {', '.join(bad) or '(none)'}; "
            f"give a comma list of {', '.join(NAMES)}, or all"
        )
    # the flat scheme is the plan's own grid, and the others are compared against it
    return tuple(s for s in SCHEMES if s.name in names or s is FLAT)


def check_names(given: str | Sequence[str]) -> tuple[str, ...]:
    """``parse``'s schemes by name: what a plan's options record."""
    return tuple(s.name for s in parse(given))


def timed() -> tuple[Scheme, ...]:
    """The schemes the step-time model has collectives for."""
    return tuple(s for s in SCHEMES if s.collectives is not None)
