"""``--model package.module:factory``: an architecture from code, weights from SOURCE.

The factory is any zero-argument callable returning an ``nn.Module``, imported
with the current directory on ``sys.path`` (as ``uvicorn app:app`` does), or from a
file: ``--model path/to/models.py:build``. It is first called on the meta device,
so describing a 70B architecture costs nothing; ``build_with_weights`` calls it
again on the CPU and copies the weights in.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..engine.module_spec import spec_from_module
from ..engine.records import ModelSpec
from ..errors import SourceError
from .loaded import LoadedModel, cwd_importable


def resolve_factory(text: str):
    """``pkg.mod:fn`` or ``path/file.py:fn`` -> the callable."""
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr:
        raise SourceError(f"--model {text!r}: expected package.module:factory or file.py:factory")
    try:
        module = _import(target)
    except SourceError:
        raise
    except Exception as exc:
        raise SourceError(
            f"--model {text!r}: importing {target!r} failed ({type(exc).__name__}: {exc})"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SourceError(f"--model {text!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SourceError(f"--model {text!r}: {attr!r} is not callable")
    return obj


def _import(target: str):
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        if not path.is_file():
            raise SourceError(f"--model: no such file {target!r}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        spec.loader.exec_module(module)
        return module
    cwd_importable()
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise SourceError(f"--model: cannot import {target!r} ({exc})") from None


def build_meta(factory, label: str) -> nn.Module:
    """The architecture on the meta device (no memory for weights)."""
    try:
        with torch.device("meta"):
            module = factory()
    except Exception as exc:
        raise SourceError(
            f"--model {label!r}: the factory failed ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(module, nn.Module):
        raise SourceError(
            f"--model {label!r}: returned a {type(module).__name__}, not an nn.Module"
        )
    return module


def attach_factory(text: str, loaded: LoadedModel | None) -> LoadedModel:
    factory = resolve_factory(text)
    module = build_meta(factory, text)
    spec = spec_from_module(module, source=text, source_kind="factory")
    if loaded is None:
        return LoadedModel(spec=spec, module=module, factory=factory)
    spec = fit_weights(spec, loaded.spec, label=f"--model {text}")
    return LoadedModel(
        spec=replace(
            spec, source=f"{loaded.spec.source} with --model {text}", metadata=loaded.spec.metadata
        ),
        reader=loaded.reader,
        module=module,
        factory=factory,
        path=loaded.path,
        extra={k: v for k, v in loaded.extra.items() if k != "names"},
    )


def fit_weights(arch: ModelSpec, weights: ModelSpec, *, label: str) -> ModelSpec:
    """Check that the weights fit the architecture; the weights' dtypes win.

    Every persistent tensor of the architecture must be stored under one of its
    names (a tied tensor stored once is fine), with the same shape; the weights may
    hold nothing else.
    """
    stored = weights.by_name()
    missing, shapes, records = [], [], []
    covered: set[str] = set()
    for t in arch.tensors:
        hit = next((stored[n] for n in t.names if n in stored), None)
        if hit is None:
            if t.persistent:
                missing.append(t.name)
            records.append(t)
            continue
        covered.update(hit.names)
        if hit.shape != t.shape:
            shapes.append(f"{t.name}: weights {list(hit.shape)}, model {list(t.shape)}")
        records.append(replace(t, dtype=hit.dtype))
    unexpected = [n for n in stored if n not in covered and n not in arch.by_name()]
    problems = []
    if missing:
        problems.append(f"missing {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {_some(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch {_some(shapes)}")
    if problems:
        raise SourceError(f"the weights do not fit {label}: " + "; ".join(problems))
    return replace(arch, tensors=tuple(records))


def _some(items: list[str], limit: int = 3) -> str:
    more = f" (and {len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
