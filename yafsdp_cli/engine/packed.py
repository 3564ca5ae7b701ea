"""The packed storage of a bitsandbytes-quantized weight, as its documented format lays
it out, so a quantized (QLoRA) base is counted from the bytes it holds.

[Note: the formats, per weight of ``n`` elements and ``out`` rows]
- 4-bit (``nf4``, ``fp4``; ``Linear4bit``/``Params4bit``): two 4-bit codes per byte,
  ``weight`` uint8 of shape (ceil(n / 2), 1); one float32 ``absmax`` per block of 64
  elements (ceil(n / 64) of them); the 16-entry float32 code table (``quant_map``).
- 4-bit with nested ("double") quantization (``nf4-dq``, ``fp4-dq``;
  ``bnb_4bit_use_double_quant``, what the QLoRA paper trains with): the absmax values
  themselves quantized to one uint8 each, in blocks of 256 with one float32 absmax
  per block (``nested_absmax``), one float32 ``offset``, and their own 256-entry
  float32 code table (``nested_quant_map``), one per layer (bitsandbytes 0.50 makes
  a tensor for each quantized weight).
- 8-bit (``int8``; LLM.int8(), ``Linear8bitLt``/``Int8Params``): ``weight`` int8 of
  the weight's own shape and one float32 scale per output row (``SCB``).

Torch-free: the memory model and the spec read these sizes; ``packed_linear`` builds
the stand-in layer that holds tensors of exactly these shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import YafsdpError

BLOCK = 64  # elements per absmax block (bnb_4bit's default blocksize)
NESTED_BLOCK = 256  # absmax values per nested block
CODES_4BIT = 16  # entries of the nf4/fp4 code table
CODES_NESTED = 256  # entries of the nested (uint8 absmax) code table
KINDS = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")


@dataclass(frozen=True, slots=True)
class PackedPart:
    """One tensor of a quantized weight: ``weight`` itself or one beside it."""

    suffix: str  # "" for the weight; "_absmax" etc. for the tensors beside it
    shape: tuple[int, ...]
    dtype: str  # canonical dtype name

    @property
    def nbytes(self) -> int:
        size = {"uint8": 1, "int8": 1, "float32": 4}[self.dtype]
        return math.prod(self.shape) * size


def check_quantize(kind: str | None) -> None:
    if kind is not None and kind not in KINDS:
        raise YafsdpError(f"--quantize {kind!r}: choose one of {', '.join(KINDS)}")


def packed_parts(kind: str, shape: tuple[int, ...]) -> tuple[PackedPart, ...]:
    """The tensors bitsandbytes keeps for a weight of ``shape`` (see the note)."""
    check_quantize(kind)
    n = math.prod(shape)
    if kind == "int8":
        return (PackedPart("", tuple(shape), "int8"), PackedPart("_scb", (shape[0],), "float32"))
    blocks = -(-n // BLOCK)
    parts = [
        PackedPart("", (-(-n // 2), 1), "uint8"),
        PackedPart("_quant_map", (CODES_4BIT,), "float32"),
    ]
    if kind.endswith("-dq"):
        parts += [
            PackedPart("_absmax", (blocks,), "uint8"),
            PackedPart("_nested_absmax", (-(-blocks // NESTED_BLOCK),), "float32"),
            PackedPart("_offset", (), "float32"),
            PackedPart("_nested_quant_map", (CODES_NESTED,), "float32"),
        ]
    else:
        parts.append(PackedPart("_absmax", (blocks,), "float32"))
    return tuple(parts)


def packed_bytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes a quantized weight of ``shape`` holds, every tensor beside it included."""
    return sum(p.nbytes for p in packed_parts(kind, shape))
