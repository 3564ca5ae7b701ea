"""A deep model's kernels from short ones: one period of the layer stack, repeated.

A step's kernels (``step_costs.count_step``) are a prefix (embedding), each layer's
in turn, the head and loss; the backward's mirror them; the optimizer's are one per
parameter (``for-loop``) or one per list of them (``foreach``, ``fused``). So the
kernels of a model cut to ``d`` layers and of one cut to ``d + p`` (``p``: the
stack's period, ``profiling.layer_stack``) differ by whole periods' kernels
inserted where the layers run, and by the list kernels' FLOPs and bytes, which grow
with the parameters they take.

``extrapolate`` takes the counts at three depths ``d``, ``d + p`` and ``d + 2p``.
From the first two it finds where kernels were inserted and which changed (a diff
of the two kernel lists, kernel by kernel: name, phase, dtype, recompute and every
figure). It writes the third from the first two (each insertion twice, each changed
kernel's figures on the line through the first two) and compares it with the third
count, kernel for kernel. Only where they are equal is the step of the whole stack
written the same way; otherwise the caller counts the whole model.
"""

from __future__ import annotations

import dataclasses
from difflib import SequenceMatcher

from .op_costs import OpCost

FIGURES = ("matrix_flops", "model_flops", "vector_flops", "bytes")


def _key(op: OpCost) -> tuple:
    return op.name, op.phase, op.dtype, op.recompute


def _edits(a: list[OpCost], b: list[OpCost]) -> list[tuple] | str:
    """How ``b`` is ``a`` one period deeper: a list of ``("same", ops)``,
    ``("insert", ops)`` and ``("grow", from, to)`` pieces; or why it is not."""
    matcher = SequenceMatcher(None, a, b, autojunk=False)
    out: list[tuple] = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out.append(("same", a[i1:i2]))
        elif tag == "insert":
            out.append(("insert", b[j1:j2]))
        elif (
            tag == "replace"
            and i2 - i1 == j2 - j1
            and all(_key(x) == _key(y) for x, y in zip(a[i1:i2], b[j1:j2]))
        ):
            out.append(("grow", a[i1:i2], b[j1:j2]))
        else:
            return f"{i2 - i1} kernels of the shorter count are not in the longer one"
    return out


def _written(edits: list[tuple], n: int) -> list[OpCost]:
    """The kernels ``n`` periods deeper than the shorter count of ``edits``."""
    ops: list[OpCost] = []
    for piece in edits:
        if piece[0] == "same":
            ops += piece[1]
        elif piece[0] == "insert":
            ops += list(piece[1]) * n
        else:
            ops += [_on_line(x, y, n) for x, y in zip(piece[1], piece[2])]
    return ops


def _on_line(x: OpCost, y: OpCost, n: int) -> OpCost:
    return dataclasses.replace(
        x, **{f: getattr(x, f) + n * (getattr(y, f) - getattr(x, f)) for f in FIGURES}
    )


def _counts_on_line(x: dict[str, int], y: dict[str, int], n: int) -> dict[str, int]:
    keys = sorted(set(x) | set(y))
    out = {k: x.get(k, 0) + n * (y.get(k, 0) - x.get(k, 0)) for k in keys}
    return {k: v for k, v in out.items() if v}


def extrapolate(counts: list, periods: int) -> tuple | str:
    """The kernels, trainable parameters and attention kernels of the step
    ``periods`` periods deeper than ``counts[0]`` (``StepCosts`` at depths ``d``,
    ``d + p``, ``d + 2p``), or why they cannot be written so."""
    a, b, c = counts
    edits = _edits(list(a.ops), list(b.ops))
    if isinstance(edits, str):
        return edits
    checked = _written(edits, 2)
    if checked != list(c.ops):
        at = next(
            (i for i, (x, y) in enumerate(zip(checked, c.ops)) if x != y),
            min(len(checked), len(c.ops)),
        )
        return (
            f"the kernels written two periods deeper differ from the count there at kernel "
            f"{at} of {len(c.ops)}"
        )
    params = a.params + 2 * (b.params - a.params)
    attention = _counts_on_line(a.attention, b.attention, 2)
    if params != c.params or attention != c.attention:
        return "the parameters or attention kernels do not grow by a period's"
    return (
        tuple(_written(edits, periods)),
        a.params + periods * (b.params - a.params),
        _counts_on_line(a.attention, b.attention, periods),
    )
