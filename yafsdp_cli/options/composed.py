"""A command's options: the pieces it stores, plus its own fields.

A ``Composed`` dataclass has fields ``layout``, ``step`` and/or ``memory`` (the
pieces) and the command's own fields. It is built either from pieces or, as a
convenience, from the flat keywords the command line and ``dataclasses.replace``
use: each flat keyword is routed to the piece that owns it (a command's own field
of the same name wins), so ``VerifyOptions(filters=("linear",), optimizer="sgd")``
stores ``LayoutOptions(filters=("linear",))`` and ``StepOptions(optimizer="sgd")``,
and each piece validates what it holds. Reading ``opts.filters`` reads the piece's.

``FIELDS`` names the flat options a command accepts, in the order its documents
list them (``flat()``); ``DEFAULTS`` are the command's own defaults of piece fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from .pieces import LayoutOptions, MemoryOptions, StepOptions

PIECES: dict[str, type] = {"layout": LayoutOptions, "step": StepOptions, "memory": MemoryOptions}
_OWNER = {f.name: piece for piece, kind in PIECES.items() for f in dataclasses.fields(kind)}


def route(flat: Mapping[str, Any], pieces=PIECES) -> dict[str, dict[str, Any]]:
    """``{"world_size": 2, "seed": 1}`` -> ``{"layout": {"world_size": 2}, "step": {...}}``;
    a name no piece owns raises ``TypeError`` (as a dataclass does)."""
    out: dict[str, dict[str, Any]] = {name: {} for name in pieces}
    for key, value in flat.items():
        owner = _OWNER.get(key)
        if owner not in out:
            raise TypeError(f"unexpected option {key!r}")
        out[owner][key] = value
    return out


class Composed:
    """Base of the commands' options (see the module docstring)."""

    __slots__ = ()
    FIELDS: ClassVar[tuple[str, ...]] = ()
    DEFAULTS: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **given: Any) -> None:
        fields = {f.name: f for f in dataclasses.fields(self)}
        pieces = {name: kind for name, kind in PIECES.items() if name in fields}
        flat = {k: v for k, v in given.items() if k not in fields}
        unknown = set(flat) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option {', '.join(sorted(unknown))}")
        routed = route(flat, pieces)
        for name, kind in pieces.items():
            base = given.get(name)
            if base is None:
                owned = {k: v for k, v in self.DEFAULTS.items() if _OWNER.get(k) == name}
                base = kind(**{**owned, **routed[name]})
            elif routed[name]:
                base = dataclasses.replace(base, **routed[name])
            object.__setattr__(self, name, base)
        for name, f in fields.items():
            if name in pieces:
                continue
            if name in given:
                value = given[name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                raise TypeError(f"{type(self).__name__} needs {name}")
            object.__setattr__(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __getattr__(self, name: str) -> Any:
        owner = _OWNER.get(name)
        if owner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, owner), name)

    def flat(self) -> dict[str, Any]:
        """The options as flat keywords, in ``FIELDS`` order: what rebuilds them."""
        return {name: getattr(self, name) for name in self.FIELDS}
