"""Fake tensors for ``profile --fake``: the mode, a fake copy of a module, and one
clear error for an op fake tensors cannot run."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from ..engine import dtypes
from ..engine.module_spec import collect_tensors
from ..errors import YafsdpError


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


@contextlib.contextmanager
def _fake_errors(fake: bool):
    """Under --fake, an op fake tensors cannot run is one clear error, and torch's
    fake-tensor logger does not print its traceback first."""
    if not fake:
        yield
        return
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    except YafsdpError as exc:
        cause = exc.__cause__
        if cause is None:
            raise
        raise YafsdpError(_fake_message(cause)) from cause
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        raise YafsdpError(_fake_message(exc)) from exc
    finally:
        log.setLevel(level)


def _fake_message(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return (
        f"--fake: this model does not run on fake tensors ({type(exc).__name__}: {first}); "
        "profile it without --fake, or on the device its kernels need"
    )


def fake_copy(module: nn.Module, spec, device: str) -> nn.Module:
    """``module`` (meta or real) with every tensor replaced by an empty one of the
    same shape, in the dtype the weights have; call inside a FakeTensorMode. Ties are
    kept (one replacement per tensor object)."""
    by_name = spec.by_name() if spec is not None else {}
    memo: dict[int, torch.Tensor] = {}
    for item in collect_tensors(module):
        t = item.tensor
        record = by_name.get(item.names[0])
        dtype = dtypes.to_torch(record.dtype) if record is not None else t.dtype
        new = torch.empty(t.shape, dtype=dtype, device=device)
        if item.is_param:
            new = nn.Parameter(new, requires_grad=t.requires_grad)
        memo[id(t)] = new
    return copy.deepcopy(module, memo)
