"""Float32 master weights of a mixed-precision run, as optimizer state.

A run that keeps its weights in bfloat16 or float16 steps float32 copies of them
(master weights) and rounds each step's result into the weights. The frameworks that
do this keep the copy in the optimizer's per-parameter state, beside the moments:
Transformer Engine's ``FusedAdam(master_weights=True)`` (what Megatron-core's
precision-aware optimizer and NeMo run) as ``master_param``, Megatron-core's
distributed optimizer, in its per-parameter checkpoint format, as ``fp32_param``. So
that is where yafsdp reads them: state field ``master_param`` or ``fp32_param`` of a
parameter, in any source whose optimizer state it reads. In the flat checkpoint a
master is one more state buffer, ``B@master_param`` (the source's field name), with
its parameters' layout.

Checked before anything is written, since a resume from a wrong master is silently
wrong: a master has its parameter's shape; it is float32 or float64 and no narrower
than its parameter (a float16 copy, or Transformer Engine's int16 remainders, are not
the masters yafsdp resumes); one field name for the whole checkpoint; and either every
parameter of a flat buffer has one or none does, and every trained parameter narrower
than float32 has one once any parameter has (float32 parameters may step themselves,
as some Transformer Engine versions leave them). A master buffer exists only for the
buffers whose parameters have masters.

A tensor beside the weights and the optimizer keyed by a parameter's name with its
shape (a ``{"master_weights": {name: tensor}}`` entry, an EMA copy) is refused by name:
no framework's convention says what it is, and carried as an opaque value it would
neither be sharded nor resumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..engine import dtypes
from ..engine.layout import Layout
from ..errors import CheckpointError

MASTER_STATES = ("master_param", "fp32_param")  # Transformer Engine's, Megatron-core's
MASTER_DTYPES = ("float32", "float64")


def master_field(fields: Iterable[str]) -> str | None:
    """The master weights' field among a record's state fields, if any."""
    return next((f for f in fields if f in MASTER_STATES), None)


def check_masters(tensors, stateful: set[str], layout: Layout, where: str) -> None:
    """``tensors`` (``StateTensor``s, shapes and dtypes already checked) hold masters
    for the whole run or none; ``stateful``: the entries with any optimizer state."""
    masters = [t for t in tensors if t.field in MASTER_STATES]
    if not masters:
        return
    names = sorted({t.field for t in masters})
    if len(names) > 1:
        raise CheckpointError(
            f"{where}: master weights under two names, {names[0]!r} and {names[1]!r}; one "
            "optimizer keeps them under one name; pass --weights-only to convert the weights alone"
        )
    owner = {n: (b, e) for b in layout.buffers for e in b.entries for n in e.names}
    has: dict[str, str] = {}  # entry name -> the parameter name the master was under
    for t in masters:
        has[owner[t.param][1].name] = t.param
    _check_coverage(layout, has, stateful, names[0], where)


def check_master_dtype(field: str, param: str, dtype: str, weight: str, where: str) -> None:
    if dtype not in MASTER_DTYPES or dtypes.itemsize(dtype) < dtypes.itemsize(weight):
        raise CheckpointError(
            f"{where}: master weight {field!r} of {param!r} is {dtype}, but master weights "
            f"are float32 or float64, at least as wide as their {weight} parameter; pass "
            "--weights-only to convert the weights alone"
        )


def _check_coverage(layout: Layout, has: dict, stateful: set[str], field: str, where: str):
    some = next(iter(has.values()))
    for b in layout.buffers:
        with_master = [e for e in b.entries if e.name in has]
        narrow = dtypes.itemsize(b.dtype) < 4
        for e in b.entries:
            if e.name in has or not (with_master or (narrow and e.name in stateful)):
                continue
            why = (
                f"{has[with_master[0].name]!r}, in the same flat buffer, has one"
                if with_master
                else f"{some!r} has one"
            )
            raise CheckpointError(
                f"{where}: {e.name!r} ({e.dtype}) has no master weight {field!r}, but {why}; "
                "a mixed-precision run keeps masters for all its parameters narrower than "
                "float32, so the checkpoint is incomplete"
            )


def check_recorded_masters(found: dict[str, dict[str, str]], layout: Layout, where: str) -> None:
    """A flat checkpoint's record of masters (``found``: field -> buffer -> dtype):
    one field, for flat buffers that exist, float32 or float64, no narrower than them."""
    fields = [f for f in found if f in MASTER_STATES]
    if len(fields) > 1:
        raise CheckpointError(f"{where}: master weights under two names; the metadata was modified")
    weights = {b.name: b.dtype for b in layout.buffers}
    for field in fields:
        for name, dtype in found[field].items():
            if name not in weights:
                raise CheckpointError(
                    f"{where}: master weights for {name!r}, which is no flat buffer; the "
                    "metadata was modified"
                )
            check_master_dtype(field, name, str(dtype), weights[name], where)


def refuse_param_copies(extras: Iterable[tuple[tuple, Any]], layout: Layout, where: str) -> None:
    """Refuse a value outside the weights and the optimizer state that is a tensor
    keyed by a parameter's name, with that parameter's shape."""
    shapes = {n: tuple(e.shape) for b in layout.buffers for e in b.entries for n in e.names}
    for path, value in extras:
        for key, t in _tensors(path, value):
            name = key[-1] if key else None
            if isinstance(name, str) and shapes.get(name) == tuple(t.shape):
                fqn = ".".join(str(k) for k in key)
                raise CheckpointError(
                    f"{where}: {fqn!r} is a copy of parameter {name!r} outside the optimizer "
                    "state (master weights? an EMA?), which yafsdp does not carry; master "
                    f"weights are read as the optimizer state field {MASTER_STATES[0]!r} or "
                    f"{MASTER_STATES[1]!r}; pass --weights-only to convert the weights alone"
                )


def _tensors(path: tuple, value: Any) -> Iterator[tuple[tuple, Any]]:
    """The tensors in ``value`` (nested dicts walked), each with its key path."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors((*path, k), v)
    elif type(value).__name__ == "Tensor":  # torch is imported only by sources that hold one
        yield path, value
