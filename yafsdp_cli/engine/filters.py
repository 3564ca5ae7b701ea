"""The filter language that picks which parameters are converted.

Expressions (a parameter is selected if any ``--filter`` matches and no
``--exclude`` does):

============== =====================================================================
``linear``     owner is a linear layer (also ``embedding``, ``conv``, ``norm``)
``type:Name``  owner's class name is ``Name`` (``type:LlamaRMSNorm``)
``name:GLOB``  full parameter name (or a tied alias) matches the fnmatch glob
``re:REGEX``   ``re.search`` finds REGEX in the full name (or an alias)
``dtype:bf16`` parameter dtype (any alias: ``bf16``, ``bfloat16``, ``fp32``...)
``min-numel:N`` at least N elements
``all``        every parameter
============== =====================================================================

With no ``--filter`` every floating-point parameter is selected. Module kinds and
``type:`` need an architecture; names, dtypes and sizes work from a header alone.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import FilterError, YafsdpError
from . import dtypes
from .records import MODULE_KINDS, ModelSpec, TensorRecord
from .units import example_names

_SYNTAX = (
    "use linear, embedding, conv, norm, type:ClassName, name:GLOB, re:REGEX, "
    "dtype:DTYPE, min-numel:N or all"
)
_NEEDS_ARCH = (
    "which a bare state dict does not have; give one with --model package.module:factory "
    "or a Hugging Face folder with config.json, or select by name:GLOB / re:REGEX instead"
)


@dataclass(frozen=True, slots=True)
class Filter:
    text: str  # as the user wrote it
    op: str  # "kind", "type", "name", "re", "dtype", "min-numel", "all"
    value: object = None

    @property
    def needs_architecture(self) -> bool:
        return self.op in ("kind", "type")

    def matches(self, t: TensorRecord) -> bool:
        if self.op == "all":
            return True
        if self.op == "kind":
            return self.value in t.kinds
        if self.op == "type":
            return self.value in t.module_types
        if self.op == "name":
            return any(fnmatch.fnmatchcase(n, self.value) for n in t.names)
        if self.op == "re":
            return any(self.value.search(n) for n in t.names)
        if self.op == "dtype":
            return t.dtype == self.value
        return t.numel >= self.value  # min-numel


def parse_filter(text: str) -> Filter:
    """Parse one expression; raises ``FilterError`` naming the expression."""
    expr = text.strip()
    if expr in MODULE_KINDS:
        return Filter(text, "kind", expr)
    if expr == "all":
        return Filter(text, "all")
    op, sep, arg = expr.partition(":")
    if not sep or not arg:
        raise FilterError(f"cannot parse filter {text!r}: {_SYNTAX}")
    if op == "type":
        return Filter(text, "type", arg)
    if op == "name":
        return Filter(text, "name", arg)
    if op == "re":
        try:
            return Filter(text, "re", re.compile(arg))
        except re.error as exc:
            raise FilterError(f"filter {text!r}: bad regular expression ({exc})") from None
    if op == "dtype":
        try:
            return Filter(text, "dtype", dtypes.canonical(arg))
        except YafsdpError as exc:
            raise FilterError(f"filter {text!r}: {exc}") from None
    if op == "min-numel":
        if not arg.isdigit():
            raise FilterError(f"filter {text!r}: min-numel takes a whole number, got {arg!r}")
        return Filter(text, "min-numel", int(arg))
    raise FilterError(f"cannot parse filter {text!r}: unknown kind {op!r}; {_SYNTAX}")


def default_selected(t: TensorRecord) -> bool:
    return t.is_param and t.floating


class Selection(Protocol):
    """Which parameters a layout converts: ``options.LayoutOptions`` (the engine
    cannot import the options room, which sits above it, so it names what it reads)."""

    filters: Sequence[str]
    excludes: Sequence[str]


def select(spec: ModelSpec, selection: Selection | None = None) -> tuple[TensorRecord, ...]:
    """The parameters ``selection`` converts (None: every floating parameter), in
    model order.

    Raises ``FilterError`` for a malformed expression, for a module-kind filter on a
    spec without architecture, and for a ``--filter`` that matches no parameter (the
    message lists what the model has).
    """
    incl = [parse_filter(f) for f in (selection.filters if selection else ())]
    excl = [parse_filter(f) for f in (selection.excludes if selection else ())]
    params = spec.params
    for f in (*incl, *excl):
        if f.needs_architecture and not spec.has_architecture:
            raise FilterError(f"filter {f.text!r} needs the model's architecture, {_NEEDS_ARCH}")
    for f in incl:
        if not any(f.matches(t) for t in params):
            raise FilterError(f"filter {f.text!r} matches no parameter; {describe(spec)}")
    chosen = []
    for t in params:
        included = any(f.matches(t) for f in incl) if incl else default_selected(t)
        if included and not any(f.matches(t) for f in excl):
            chosen.append(t)
    return tuple(chosen)


def describe(spec: ModelSpec) -> str:
    """One line saying what parameters exist: kinds, types, dtypes, name shapes."""
    params = spec.params
    parts = [f"the model has {len(params)} parameters"]
    if spec.has_architecture:
        kinds = Counter(k for t in params for k in t.kinds)
        if kinds:
            parts.append("kinds " + ", ".join(f"{k} ({n})" for k, n in kinds.most_common()))
        types = Counter(m for t in params for m in t.module_types)
        parts.append("types " + ", ".join(f"{k} ({n})" for k, n in types.most_common(6)))
    dts = Counter(t.dtype for t in params)
    parts.append("dtypes " + ", ".join(f"{dtypes.short(k)} ({n})" for k, n in dts.most_common()))
    parts.append("names like " + ", ".join(example_names([t.name for t in params], 4)))
    return "; ".join(parts)
