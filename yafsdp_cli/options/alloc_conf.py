"""The CUDA caching allocator's settings, read from ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

>>> conf = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
>>> conf.expandable_segments, conf.max_split_size
(True, 134217728)
>>> str(conf)
'expandable_segments:True,max_split_size_mb:128'

Only the options that change where blocks go are kept (``AllocatorConf``); options
that change nothing a replay can see (``backend:native``,
``release_lock_on_cudamalloc``, the ``pinned_*`` host-memory ones) are accepted and
dropped, so a string copied from a real job parses. Values are checked as PyTorch
checks them (``c10/cuda/CUDAAllocatorConfig.cpp``): ``max_split_size_mb`` above
20, divisions powers of two, a threshold strictly between 0 and 1; and, where
PyTorch would wrap a ``size_t``, as every number is checked here
(``numbers.checked``): sizes at most 1 EiB, divisions at most 2**20.

A setting comes from ``--alloc-conf`` or, without it, the ``PYTORCH_CUDA_ALLOC_CONF``
variable (``allocator_setting``); every error names the one it came from, since the
variable may be set far from the command line that fails.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import YafsdpError
from ..numbers import MAX_BYTES, MAX_COUNT, problem, shown

MIB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize: every size rounds up to a multiple
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: the segment of a 1-10 MiB request
ROUNDUP_INTERVALS = 16  # one divisions setting per power of two from 1 MiB up
_IGNORED = {
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "pinned_num_register_threads",
    "pinned_use_background_threads",
    "pinned_reserve_segment_size_mb",
}
_KEYS = {
    "expandable_segments",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
}
_FIELD = {  # the setting's name -> AllocatorConf's field (which holds bytes, not MiB)
    "max_split_size_mb": "max_split_size",
    "max_non_split_rounding_mb": "max_non_split_rounding",
}
ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_FLAG = "--alloc-conf"
MAX_MB = MAX_BYTES // MIB  # a size setting in MiB
_HINT = (
    "write key:value pairs separated by commas, e.g. expandable_segments:True,max_split_size_mb:128"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class AllocatorConf:
    """The settings a replay follows; the defaults are PyTorch's."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: no limit (blocks of any size split)
    max_non_split_rounding: int = LARGE_BUFFER  # an oversize request takes a block < size + this
    garbage_collection_threshold: float = 0.0  # 0: off
    # divisions per size interval: [i] for [2**i, 2**(i+1)) MiB ([0] also below 1 MiB,
    # [15] also above); 0 or 1: off
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise YafsdpError(
                f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} intervals, "
                f"got {len(self.roundup_power2_divisions)}"
            )
        if not 0.0 <= self.garbage_collection_threshold < 1.0:
            raise YafsdpError(
                "garbage_collection_threshold must be in (0, 1), "
                f"got {self.garbage_collection_threshold}"
            )

    def divisions_for(self, size: int) -> int:
        """The ``roundup_power2_divisions`` setting for a request of ``size`` bytes."""
        index = size.bit_length() - 1 - (MIB.bit_length() - 1)
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]

    def round_size(self, size: int) -> int:
        """The block size a request of ``size`` bytes asks the pools for."""
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.divisions_for(size)
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return _next_division(size, divisions)
        return -(-size // MIN_BLOCK) * MIN_BLOCK

    def __str__(self) -> str:
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding != LARGE_BUFFER:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MIB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        divs = self.roundup_power2_divisions
        if len(set(divs)) == 1 and divs[0]:
            parts.append(f"roundup_power2_divisions:{divs[0]}")
        elif any(divs):
            # unset intervals come only after the last one set: leaving them out
            # reads back the same
            listed = ",".join(f"{1 << i}:{d}" for i, d in enumerate(divs) if d)
            parts.append(f"roundup_power2_divisions:[{listed}]")
        return ",".join(parts) or "default"


def _next_division(size: int, divisions: int) -> int:
    """``size`` rounded up to the next of ``divisions`` equal steps between powers of
    two (1200 B, 4 divisions: 1024, 1280, 1536, 1792 -> 1280)."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    below = size & ~(step - 1)
    return size if below == size else below + step


def allocator_setting(given: str | None, env: Mapping[str, str] = os.environ) -> AllocatorConf:
    """The settings a replay follows: ``--alloc-conf`` when ``given``, else the
    ``PYTORCH_CUDA_ALLOC_CONF`` variable of ``env``; an error names which."""
    if given is not None:
        return parse_alloc_conf(given, ALLOC_CONF_FLAG)
    return parse_alloc_conf(env.get(ALLOC_CONF_VAR), ALLOC_CONF_VAR)


def parse_alloc_conf(text: str | None, where: str = "allocator settings") -> AllocatorConf:
    """``PYTORCH_CUDA_ALLOC_CONF`` text as an ``AllocatorConf``; empty, None or
    ``default``: PyTorch's defaults. Raises ``YafsdpError`` (one line, starting with
    ``where``: the option or the variable the text came from) on bad input."""
    if text is None or text.strip() in ("", "default"):
        return AllocatorConf()
    try:
        return _parse(text)
    except YafsdpError as exc:
        raise YafsdpError(f"{where} {shown(text)!r}: {exc}") from None


def _parse(text: str) -> AllocatorConf:
    fields: dict = {}
    for item in _split_items(text):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise YafsdpError(f"setting {shown(item)!r} is not key:value; {_HINT}")
        if key in fields:
            raise YafsdpError(f"setting {shown(key)!r} is given twice")
        if key not in _IGNORED:
            fields[key] = _parse_value(key, value)
    return AllocatorConf(**_rename(fields))


def _split_items(text: str) -> list[str]:
    """Split on the commas outside ``[...]`` (a divisions list has its own commas)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise YafsdpError("']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise YafsdpError("'[' without ']'")
    items.append(text[start:])
    return [s for s in (s.strip() for s in items) if s] or [text]


def _parse_value(key: str, value: str):
    if key == "expandable_segments":
        if value not in ("True", "False"):
            raise YafsdpError(f"expandable_segments must be True or False, got {shown(value)!r}")
        return value == "True"
    if key == "max_split_size_mb":
        mb = _integer(key, value)
        if mb <= LARGE_BUFFER // MIB:
            raise YafsdpError(f"max_split_size_mb must be above {LARGE_BUFFER // MIB}, got {mb}")
        return mb * MIB
    if key == "max_non_split_rounding_mb":
        return _integer(key, value) * MIB
    if key == "garbage_collection_threshold":
        threshold = _number(key, value)
        if not 0.0 < threshold < 1.0:
            raise YafsdpError(
                "garbage_collection_threshold must be between 0 and 1 (exclusive), "
                f"got {shown(value)}"
            )
        return threshold
    if key == "roundup_power2_divisions":
        return _divisions(value)
    known = ", ".join(sorted(_KEYS | _IGNORED))
    raise YafsdpError(f"unknown allocator setting {shown(key)!r}; known: {known}")


def _integer(key: str, value: str, high: int = MAX_MB) -> int:
    """A whole number from 0 to ``high`` (``numbers.problem``: NaN, infinities and
    400-digit integers are refused)."""
    try:
        n = int(value)
    except ValueError:  # not digits, or more digits than Python converts
        raise YafsdpError(f"{key} must be a whole number, got {shown(value)!r}") from None
    wrong = problem(n, 0, high, whole=True)
    if wrong is not None:
        raise YafsdpError(f"{key} {wrong}")
    return n


def _number(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise YafsdpError(f"{key} must be a number, got {shown(value)!r}") from None


def _power_of_two(key: str, value: str, high: int = MAX_COUNT) -> int:
    n = _integer(key, value, high)
    if n == 0 or n & (n - 1):
        raise YafsdpError(f"{key}: {n} is not a power of two")
    return n


def _divisions(value: str) -> tuple[int, ...]:
    """``4`` (every interval) or ``[256:1,512:2,>:8]`` (from a size in MiB on)."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        return (_power_of_two(key, value),) * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise YafsdpError(f"{key} {shown(value)!r}: a list ends with ']'")
    out = [0] * ROUNDUP_INTERVALS
    last = None
    for pair in filter(None, (p.strip() for p in value[1:-1].split(","))):
        size, sep, divs = pair.partition(":")
        if not sep:
            raise YafsdpError(f"{key} entry {shown(pair)!r} is not size_mb:divisions")
        n = _power_of_two(key, divs.strip())
        if size.strip() == ">":
            start = 0 if last is None else last + 1
            out[start:] = [n] * (ROUNDUP_INTERVALS - start)
            continue
        index = _power_of_two(key, size.strip(), MAX_MB).bit_length() - 1
        index = min(index, ROUNDUP_INTERVALS - 1)
        start = 0 if last is None else last + 1
        out[start : index + 1] = [n] * (index + 1 - start)
        last = index
    return tuple(out)


def _rename(fields: dict) -> dict:
    return {_FIELD.get(k, k): v for k, v in fields.items()}
