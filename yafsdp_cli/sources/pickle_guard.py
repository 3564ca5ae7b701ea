"""A pickle's opcodes checked before any unpickler runs them.

Python's C unpickler keeps its memo in an array indexed by the number a ``PUT``
opcode gives: one ``LONG_BINPUT 1298491233`` in a 1 KB file makes it allocate and
zero a 20 GB array before anything else is read, and a ``BINBYTES8`` or
``BYTEARRAY8`` length is allocated before the bytes behind it are found missing.
The pickles yafsdp reads itself (DCP ``.metadata``, the pickled entries of
``.distcp`` files) are small and written by ``pickle.Pickler``, which numbers the
memo 0, 1, 2, ... in order. So before unpickling, every opcode is walked once
(``pickletools.genops`` reads lengths against the bytes there are, allocating
nothing past them), and a memo index beyond the entries stored so far is refused.
"""

from __future__ import annotations

import pickletools

_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


class PickleShapeError(ValueError):
    """The pickle cannot be what a ``pickle.Pickler`` wrote; the message says why."""


def check_pickle(data: bytes) -> int:
    """The number of opcodes in ``data``, one pickle; ``PickleShapeError`` for a
    truncated pickle, a length past its end, or a memo index out of order."""
    stored = 0  # memo entries so far: explicit puts and MEMOIZE both add one
    count = 0
    try:
        for op, arg, _ in pickletools.genops(data):
            count += 1
            if op.name in _PUTS:
                if not isinstance(arg, int) or not 0 <= arg <= stored:
                    raise PickleShapeError(f"memo index {arg} after {stored} entries")
                stored += arg == stored
            elif op.name == "MEMOIZE":
                stored += 1
            elif op.name in _GETS and (not isinstance(arg, int) or not 0 <= arg < stored):
                raise PickleShapeError(f"memo index {arg} read, of {stored} entries")
    except PickleShapeError:
        raise
    except ValueError as exc:  # genops: a length past the end, an unknown opcode
        raise PickleShapeError(str(exc).splitlines()[0][:200] if str(exc) else "garbled") from None
    return count
