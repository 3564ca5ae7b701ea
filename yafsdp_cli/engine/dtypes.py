"""Dtype names without importing torch.

The library names dtypes the way torch prints them without the ``torch.`` prefix
(``"bfloat16"``, ``"float32"``), so layouts and memory models can be computed from a
safetensors header alone. ``to_torch``/``from_torch`` convert at the edges.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError


@dataclass(frozen=True, slots=True)
class DtypeInfo:
    name: str  # canonical name, e.g. "bfloat16"
    itemsize: int  # bytes per element
    floating: bool
    safetensors: str  # safetensors header code, e.g. "BF16"
    aliases: tuple[str, ...] = ()


_TABLE = (
    DtypeInfo("float64", 8, True, "F64", ("f64", "fp64", "double")),
    DtypeInfo("float32", 4, True, "F32", ("f32", "fp32", "float")),
    DtypeInfo("float16", 2, True, "F16", ("f16", "fp16", "half")),
    DtypeInfo("bfloat16", 2, True, "BF16", ("bf16",)),
    DtypeInfo("float8_e4m3fn", 1, True, "F8_E4M3", ("fp8", "f8_e4m3", "e4m3")),
    DtypeInfo("float8_e5m2", 1, True, "F8_E5M2", ("f8_e5m2", "e5m2")),
    DtypeInfo("complex64", 8, False, "C64", ("c64",)),
    DtypeInfo("int64", 8, False, "I64", ("i64", "long")),
    DtypeInfo("int32", 4, False, "I32", ("i32", "int")),
    DtypeInfo("int16", 2, False, "I16", ("i16", "short")),
    DtypeInfo("int8", 1, False, "I8", ("i8",)),
    DtypeInfo("uint64", 8, False, "U64", ("u64",)),
    DtypeInfo("uint32", 4, False, "U32", ("u32",)),
    DtypeInfo("uint16", 2, False, "U16", ("u16",)),
    DtypeInfo("uint8", 1, False, "U8", ("u8", "byte")),
    DtypeInfo("bool", 1, False, "BOOL", ()),
)

_BY_NAME = {info.name: info for info in _TABLE}
_BY_ANY = {
    key.lower(): info for info in _TABLE for key in (info.name, info.safetensors, *info.aliases)
}
_BY_SAFETENSORS = {info.safetensors: info for info in _TABLE}


def dtype_info(name: str) -> DtypeInfo:
    """Look up a dtype by canonical name, alias (``bf16``) or safetensors code."""
    info = _BY_ANY.get(name.lower().removeprefix("torch."))
    if info is None:
        known = ", ".join(sorted(_BY_NAME))
        raise YafsdpError(f"unknown dtype {name!r}; known dtypes: {known}")
    return info


def canonical(name: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; raises ``YafsdpError`` for an unknown name."""
    return dtype_info(name).name


def itemsize(name: str) -> int:
    return dtype_info(name).itemsize


def is_floating(name: str) -> bool:
    return dtype_info(name).floating


# The size rule of every reader: a file's offsets are 64-bit, so a tensor past this
# is a lie; no checkpoint format needs more dimensions than numpy allows.
MAX_TENSOR_BYTES = 2**63 - 1
MAX_DIMS = 64


def shape_problem(shape, dtype: str) -> str | None:
    """Why ``shape`` (read from a file) is no shape of a ``dtype`` tensor, or None.

    Every reader checks a shape with this before it computes or prints anything
    from it, so ``inspect`` refuses what ``convert`` refuses: the dimensions are plain
    non-negative ints (not bools, not nested lists), at most ``MAX_DIMS`` of them, and
    the tensor's bytes fit ``MAX_TENSOR_BYTES``. The product is taken with an early
    stop, so a shape of huge numbers costs no big-number arithmetic."""
    if not isinstance(shape, (list, tuple)) or not all(type(d) is int for d in shape):
        return "its dimensions are not all whole numbers"
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions, more than {MAX_DIMS}"
    if any(d < 0 for d in shape):
        return "a negative dimension"
    if 0 in shape:
        return None
    total = itemsize(dtype)
    for d in shape:
        total *= d
        if total > MAX_TENSOR_BYTES:
            return f"{dtype} of that shape is more than 2^63 bytes"
    return None


def from_safetensors(code: str) -> str:
    info = _BY_SAFETENSORS.get(code)
    if info is None:
        raise YafsdpError(f"unsupported safetensors dtype {code!r}")
    return info.name


def to_safetensors(name: str) -> str:
    return dtype_info(name).safetensors


def short(name: str) -> str:
    """Compact display name: ``"bfloat16"`` -> ``"bf16"``."""
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}.get(
        name, name
    )


def to_torch(name: str):  # -> torch.dtype; torch is imported only when asked
    import torch

    return getattr(torch, canonical(name))


def from_torch(dtype) -> str:
    return canonical(str(dtype))
