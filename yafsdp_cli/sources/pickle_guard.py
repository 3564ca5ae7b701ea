"""A pickle's opcodes checked before any unpickler runs them.

Python's C unpickler keeps its memo in an array indexed by the number a ``PUT``
opcode gives: one ``LONG_BINPUT 1298491233`` in a 1 KB file makes it allocate and
zero a 20 GB array before anything else is read, and a ``BINBYTES8`` or
``BYTEARRAY8`` length is allocated before the bytes behind it are found missing.
Tuples are the other hazard: the unpickler hashes a dict key as it stores it, and a
tuple's hash walks the whole tuple recursively in C, so a key nested 200,000 deep
overflows the C stack (a segmentation fault, not an exception), and a key built of
one tuple referenced twice at each of 60 levels takes 2^60 steps.

The pickles yafsdp reads itself (DCP ``.metadata``, the pickled entries of
``.distcp`` files) are written by ``pickle.Pickler``, which numbers the memo 0, 1,
2, ... in order, and hold tuples a few levels deep (offsets, sizes, key paths). So
before unpickling, every opcode is walked once (``pickletools.genops`` reads lengths
against the bytes there are, allocating nothing past them) with a stand-in stack
that tracks each tuple's depth and its size counted with repeats; a memo index out
of order, or a tuple past ``MAX_TUPLE_DEPTH`` or over ``TUPLE_ITEMS_PER_BYTE`` items
per byte of the pickle, is refused.
"""

from __future__ import annotations

import io
import pickletools

MAX_TUPLE_DEPTH = 64
TUPLE_ITEMS_PER_BYTE = 4  # an item costs a pickle at least one opcode, unless shared

# A stand-in stack item is one int: the items of a tuple counted with repeats, times
# 128, plus its depth (at most MAX_TUPLE_DEPTH < 128); anything else is a leaf. MARKs
# are kept apart, as positions in the stack, as the C unpickler keeps them.
_DEPTH_BITS = 7
_LEAF = 1 << _DEPTH_BITS
# What each opcode does to the stand-in stack, by kind: the memo ones, MARK, the
# tuple builders (how many items, -1: back to the MARK), and every other one as
# (takes a slice back to a MARK, items it pops besides, items it pushes).
_PUT, _MEMOIZE, _GET, _MARK_OP, _TUPLE, _OTHER = range(6)
_TUPLE_N = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "TUPLE": -1}


def _action(op) -> tuple:
    name = op.name
    if name in ("PUT", "BINPUT", "LONG_BINPUT"):
        return (_PUT,)
    if name == "MEMOIZE":
        return (_MEMOIZE,)
    if name in ("GET", "BINGET", "LONG_BINGET"):
        return (_GET,)
    if name == "MARK":
        return (_MARK_OP,)
    if name in _TUPLE_N:
        return (_TUPLE, _TUPLE_N[name])
    before = op.stack_before
    mark = pickletools.markobject in before
    pops = before.index(pickletools.markobject) if mark else len(before)
    return (_OTHER, mark, pops, [_LEAF] * len(op.stack_after))


_ACTIONS = {op: _action(op) for op in pickletools.opcodes}


class PickleShapeError(ValueError):
    """The pickle cannot be what a ``pickle.Pickler`` wrote; the message says why."""


def check_pickle(data: bytes | io.BytesIO, size: int | None = None) -> int:
    """The number of opcodes in ``data``, one pickle (from a stream: the next one, the
    stream left after its STOP); ``PickleShapeError`` for a truncated pickle, a length
    past its end, a memo index out of order, or a tuple too deep or too large (counted
    with repeats) for ``size``, the bytes it came in (default: ``len(data)``)."""
    size = len(data) if size is None else size
    limit = TUPLE_ITEMS_PER_BYTE * size + 1024
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[int, int] = {}
    count = 0
    actions = _ACTIONS
    try:
        for op, arg, _ in pickletools.genops(data):
            count += 1
            act = actions[op]
            kind = act[0]
            if kind == _OTHER:
                if act[1]:
                    del stack[_mark(stack, marks) :]
                if act[2]:
                    _pop(stack, marks, act[2])
                stack += act[3]
            elif kind == _PUT:
                if not isinstance(arg, int) or not 0 <= arg <= len(memo):
                    raise PickleShapeError(f"memo index {arg} after {len(memo)} entries")
                memo[arg] = stack[-1] if stack else _LEAF
            elif kind == _MEMOIZE:
                memo[len(memo)] = stack[-1] if stack else _LEAF
            elif kind == _GET:
                if not isinstance(arg, int) or arg not in memo:
                    raise PickleShapeError(f"memo index {arg} read, of {len(memo)} entries")
                stack.append(memo[arg])
            elif kind == _MARK_OP:
                marks.append(len(stack))
            else:
                n = act[1]
                at = _mark(stack, marks) if n < 0 else len(stack) - n
                if n > 0:
                    _pop(stack, marks, 0, n)
                stack[at:] = [_tuple_of(stack[at:], limit)]
    except PickleShapeError:
        raise
    except (ValueError, IndexError) as exc:  # genops: a length past the end, a bad opcode
        raise PickleShapeError(str(exc).splitlines()[0][:200] if str(exc) else "garbled") from None
    return count


def _tuple_of(parts: list[int], limit: int) -> int:
    items = 1 + sum(p >> _DEPTH_BITS for p in parts)
    depth = 1 + max((p & (_LEAF - 1) for p in parts), default=0)
    if depth > MAX_TUPLE_DEPTH:
        raise PickleShapeError(f"a tuple nested more than {MAX_TUPLE_DEPTH} deep")
    if items > limit:
        raise PickleShapeError(
            f"a tuple of over {limit} items counted with repeats (one tuple referenced "
            "over and over), far more than its pickle's size warrants"
        )
    return items << _DEPTH_BITS | depth


def _pop(stack: list[int], marks: list[int], n: int, keep: int = 0) -> None:
    """Take ``n`` items off (or, with ``keep``, only check that ``keep`` are there
    above the last MARK), as the C unpickler does: never through a MARK."""
    floor = marks[-1] if marks else 0
    if len(stack) - (n or keep) < floor:
        raise PickleShapeError("an opcode takes more items than the pickle pushed")
    if n:
        del stack[len(stack) - n :]


def _mark(stack: list[int], marks: list[int]) -> int:
    if not marks:
        raise PickleShapeError("an opcode closes a MARK that was never opened")
    return marks.pop()
