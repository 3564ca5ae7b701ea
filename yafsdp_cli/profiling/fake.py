"""The fake step: fake weights and activations, real inputs, the real step's kernels.

[Note: real inputs, fake weights]
A plain ``FakeTensorMode`` around the step gives every tensor, the batch included,
shapes and dtypes but no values. Models read values of their *inputs* to choose a
path: transformers 5 checks whether the position ids show packed sequences and
whether the attention mask pads anything; on a FakeTensor it cannot know, so it
plays safe and builds a (batch, 1, seq, seq) mask, which takes sdpa off its
``is_causal`` kernel and saves more for backward (Qwen2 at 1 x 2048 tokens: 3.9x the
real step's peak). The values such decisions read come from the batch alone (token
ids, the positions the model makes with ``arange``, masks built from them), never
from a weight. So in the fake step:

- the batch stays real, and an op whose tensor arguments are all real runs for real
  (``FakeStep`` below, one rule for every model): positions, masks and the checks on
  them take the values and so the path of a real run;
- an op without tensor arguments (a factory: ``arange``, ``ones``) runs for real when
  it makes an integer or boolean tensor (indices and masks); floating factories
  (random noise, buffers) are fake;
- either stays fake when it would make a tensor of more than ``REAL_LIMIT`` elements
  (a (8192, 8192) mask is at the limit), so the host never holds a big one: the
  op is run fake first to see what it makes (one that cannot be, ``nonzero`` of a
  real mask, and one that writes into a real tensor run for real);
- every other op runs on FakeTensors: a model that does not fit costs no memory;
- ``kernels.OVERRIDES`` replace the fake kernels that allocate other than the real
  kernel does (``torch._grouped_mm``, transformers 5's MoE experts) and, for
  ``--target cuda``, ``kernels.CudaAttention`` puts the CUDA attention kernels in;
- an embedding looked up with real indices checks them as the kernel does, so a
  sequence longer than a position table fails fake as it fails for real;
- a real tensor that an op writes a fake value into is fake from then on (its
  values are no longer known); none of the models in the tests does this.

Real tensors in a fake step are the batch and what it alone makes: token-sized
integers and, where a model builds one, a (seq, seq) mask. A branch on the value of a
tensor computed from weights still cannot be taken without the weights: that is a
one-line error naming the op (``fake_errors``).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ..engine import dtypes
from ..engine.module_spec import collect_tensors
from ..errors import YafsdpError
from .kernels import OVERRIDES
from .positions import PositionLimitError
from .tracker import op_tensors

REAL_LIMIT = 1 << 26  # elements of one real tensor in a fake step: (8192, 8192)
_EMBEDDING = torch.ops.aten.embedding.default


def make_fake_mode() -> FakeTensorMode:
    """The FakeTensorMode of a fake step: real batch tensors are allowed in (see the note)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


class FakeStep(TorchDispatchMode):
    """Enter inside a ``make_fake_mode()``; see the note at the top of this file."""

    def __init__(self):
        super().__init__()
        # real tensors a fake value was written into: their values are unknown now, so
        # they go the fake way (FakeTensorMode keeps the fake it wrote into for each)
        self.unknown = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = op_tensors(args, kwargs.values())
        if any(isinstance(t, FakeTensor) for t in tensors) or (
            self.unknown and any(t in self.unknown for t in tensors)
        ):
            override = OVERRIDES.get(func)
            if override is not None:
                return override(*args, **kwargs)
            if func is _EMBEDDING:
                _check_indices(*args[:2])
            if func._schema.is_mutable:
                self._forget(func, args, kwargs)
            return func(*args, **kwargs)
        if func._schema.is_mutable or not _returns_tensors(func):
            # writes into real tensors (a probe would write twice); .item(): values
            return _real(func, args, kwargs)
        try:
            probe = func(*args, **kwargs)  # fake: what it would make
        except Exception:  # an output shape only a real run knows (nonzero)
            return _real(func, args, kwargs)
        outs = op_tensors(probe if isinstance(probe, (list, tuple)) else (probe,))
        if any(t.numel() > REAL_LIMIT for t in outs):
            return probe
        if not tensors and not all(_is_index(t) for t in outs):
            return probe  # a floating factory
        return _real(func, args, kwargs)

    def _forget(self, func, args, kwargs) -> None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in op_tensors([value]):
                    if not isinstance(t, FakeTensor):
                        self.unknown[t] = True


def _returns_tensors(func) -> bool:
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def _real(func, args, kwargs):
    with unset_fake_temporarily():
        return func(*args, **kwargs)


def _is_index(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


def _check_indices(weight: torch.Tensor, indices: torch.Tensor) -> None:
    """What the embedding kernel checks, where the indices are real (positions)."""
    if isinstance(indices, FakeTensor) or indices.numel() == 0:
        return
    with unset_fake_temporarily():
        lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= weight.shape[0]:
        raise IndexError(
            f"index out of range in self (index {hi if hi >= weight.shape[0] else lo}, "
            f"table of {weight.shape[0]})"
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


@contextlib.contextmanager
def fake_errors(fake: bool):
    """Under --fake, an op fake tensors cannot run is one clear error, and torch's
    fake-tensor logger does not print its traceback first."""
    if not fake:
        yield
        return
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    except YafsdpError as exc:
        cause = exc.__cause__
        if cause is None or isinstance(exc, PositionLimitError):
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


@contextlib.contextmanager
def entered(*modes):
    """Enter each mode that is not None, first outermost."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if mode is not None:
                stack.enter_context(mode)
        yield
