"""The conversion engine: a live module's parameters as views of flat buffers.

``convert_module`` copies the selected parameters into one 1-D tensor per layout
buffer and makes every one of them a view of its slice: the ``nn.Parameter``
objects stay where they were, under their names, in their order, with
``p.data = flat[offset : offset + numel].view(shape)``. So the module is still an
ordinary module to everything that walks it: ``state_dict()`` / ``load_state_dict()``
speak the original names, autograd sees ordinary leaves (activation checkpointing,
reentrant or not, needs nothing special), ``torch.compile`` sees ordinary
parameters (no graph break, no guard per entry), and a tied parameter is one object
with one slice, whose gradient autograd sums before it lands.

Gradients land in one flat gradient buffer per flat buffer (``FlatBuffer.grad``,
also the flat parameter's ``.grad``) through two hooks on every converted
parameter, so no per-parameter gradient outlives its backward:

- after ``AccumulateGrad`` (``register_post_accumulate_grad_hook``): a fresh
  gradient (the parameter had none: a new step) is copied into its region and
  ``p.grad`` becomes a view of that region; from then on ``AccumulateGrad`` adds
  in place, straight into the flat buffer (gradient accumulation);
- before it (a tensor hook), once per backward, and before every eager forward:
  ``reconcile`` sees whether the user started a new step, by either door:
  ``zero_grad()`` on the module or on an optimizer over its parameters (every
  ``p.grad`` is ``None``) or on an optimizer over the flat buffers (the flat
  parameter's ``.grad`` is ``None``). Then the old flat gradient is dropped and
  the next one starts from nothing, so a new step never adds into stale values.

"Written" is read off the tensors themselves (``p.grad is`` this buffer's view),
never kept in a side table that could disagree with them. The flat gradient is
allocated uninitialized; what no gradient reached (padding, parameters unused in
this backward) is zeroed when the backward ends (``fill_gaps``), so a step passes
over the gradient memory once.

Two ways to train: any optimizer over ``model.parameters()`` (per parameter, the
gradients are views of the flat buffer), or the metaparam way, one over
``FlatModel.parameters()`` (the flat buffers and the unconverted parameters).
``copy.deepcopy(model)`` gives a converted copy with a handle of its own
(``flat_handle``); ``FlatModel.restore()`` gives back ordinary parameters, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import ConversionError
from . import dtypes
from .flat_buffer import FlatBuffer
from .layout import BufferLayout, Layout
from .module_spec import collect_tensors

HANDLE_ATTR = "_yafsdp_flat"  # the FlatModel of a converted module, on the module


class FlatModel:
    """Handle on a module converted in place; see the module docstring."""

    def __init__(self, module: nn.Module, layout: Layout, buffers: list[FlatBuffer]):
        self.module = module
        self.layout = layout
        self.buffers = buffers
        self._index = {
            n: (b, i) for b in buffers for i, e in enumerate(b.layout.entries) for n in e.names
        }
        self._converted = {id(p) for b in buffers for p in b.params}
        self._hook = module.register_forward_pre_hook(self._pre_forward)
        self._base_class = type(module)
        module.__class__ = _deepcopyable(type(module))
        object.__setattr__(module, HANDLE_ATTR, self)

    def _pre_forward(self, _module, _args) -> None:
        # Under torch.compile the backward-time check alone does the work: this one
        # only lets an eager step free a stale gradient before the forward, not after.
        if torch.compiler.is_compiling():
            return
        for b in self.buffers:
            b.check_params()
            b.reconcile()

    # -- what the optimizer and the checks see -----------------------------------------

    def flat_parameters(self) -> Iterator[nn.Parameter]:
        return (b.param for b in self.buffers)

    def kept_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Unconverted parameters, one per tensor, by their first name."""
        return [(n, p) for n, p in self.module.named_parameters() if id(p) not in self._converted]

    def parameters(self) -> list[nn.Parameter]:
        """What a metaparam optimizer steps on: the flat buffers, then the rest."""
        return [*self.flat_parameters(), *(p for _, p in self.kept_parameters())]

    def is_converted(self, p: torch.Tensor) -> bool:
        return id(p) in self._converted

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The new-step call (as ``module.zero_grad``), for the flat gradients too."""
        self.module.zero_grad(set_to_none=set_to_none)
        for b in self.buffers:
            if set_to_none:
                b.drop_grad()
            elif b.grad is not None:
                b.grad.zero_()

    def param(self, name: str) -> torch.Tensor:
        """The current value of a converted parameter (any tied name) as a view."""
        b, i = self._lookup(name)
        return b.entry_tensor(i)

    def grad(self, name: str) -> torch.Tensor | None:
        """The gradient of a converted parameter as a view of the flat gradient."""
        b, i = self._lookup(name)
        return None if b.grad is None else b.entry_tensor(i, b.grad)

    def named_params(self) -> dict[str, torch.Tensor]:
        """Every original parameter name (tied names too) -> its current value."""
        return self._named(lambda b, i: b.entry_tensor(i), lambda p: p.detach())

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter name (tied names too) -> its gradient or None; converted
        ones as the optimizer over the flat buffers sees them (zeros where unused)."""
        return self._named(
            lambda b, i: None if b.grad is None else b.entry_tensor(i, b.grad),
            lambda p: p.grad,
        )

    def _named(self, converted, kept) -> dict:
        out = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            out[name] = converted(*self._index[name]) if name in self._index else kept(p)
        return out

    def flat_state_dict(self) -> dict[str, torch.Tensor]:
        """The flat form: buffer name -> flat tensor, then unconverted tensors by name."""
        out = {b.layout.name: b.param.detach() for b in self.buffers}
        for name, t in self.module.state_dict().items():
            if name not in self._index:
                out[name] = t
        return out

    def _lookup(self, name: str) -> tuple[FlatBuffer, int]:
        if name not in self._index:
            raise ConversionError(f"{name!r} is not a converted parameter")
        return self._index[name]

    def check_padding(self) -> None:
        """Raise ``ConversionError`` if padding in data or gradient is not zero."""
        for b in self.buffers:
            for what, t in (("data", b.param.detach()), ("grad", b.grad)):
                if t is not None and not b.padding_is_zero(t):
                    raise ConversionError(f"{b.layout.name}: padding of its {what} is not zero")

    def restore(self) -> nn.Module:
        """Give back ordinary parameters, bit for bit; the handle is dead afterwards."""
        self._hook.remove()
        for b in self.buffers:
            b.remove_hooks()
            for i, p in enumerate(b.params):
                grad = p.grad.clone() if b._ours(i) else p.grad
                p.data = b.entry_tensor(i).clone()
                p.grad = grad
            b.param = None  # drop this buffer before cloning the next one
        self.buffers = []
        self.module.__class__ = self._base_class
        self.module.__dict__.pop(HANDLE_ATTR, None)
        return self.module


def flat_handle(module: nn.Module) -> FlatModel:
    """The ``FlatModel`` of a converted module (a deep copy's own, for a copy)."""
    handle = module.__dict__.get(HANDLE_ATTR)
    if handle is None:
        raise ConversionError(f"this {type(module).__name__} is not converted")
    return handle


_DEEPCOPYABLE: dict[type, type] = {}


def _deepcopyable(cls: type) -> type:
    """``cls`` with a ``__deepcopy__`` that converts the copy the same way.

    The subclass keeps the class's name and module, so what reads them (a Hugging Face
    ``config.architectures``, a repr) sees the original class."""
    if cls not in _DEEPCOPYABLE:
        attrs = {"__deepcopy__": _deepcopy_converted, "__module__": cls.__module__}
        sub = type(cls.__name__, (cls,), attrs)
        sub.__qualname__ = cls.__qualname__
        _DEEPCOPYABLE[cls] = sub
    return _DEEPCOPYABLE[cls]


def _deepcopy_converted(self: nn.Module, memo: dict) -> nn.Module:
    handle = flat_handle(self)
    hooks = list(self._forward_pre_hooks.items())
    del self._forward_pre_hooks[handle._hook.id]
    del self.__dict__[HANDLE_ATTR]
    self.__class__ = handle._base_class
    try:
        twin = copy.deepcopy(self, memo)
    finally:
        self.__class__ = _deepcopyable(handle._base_class)
        self.__dict__[HANDLE_ATTR] = handle
        self._forward_pre_hooks.clear()
        self._forward_pre_hooks.update(hooks)
    convert_module(twin, handle.layout)
    return twin


def convert_module(module: nn.Module, layout: Layout) -> FlatModel:
    """Convert ``module`` in place to the flat-buffer form described by ``layout``.

    Every entry is checked against the module (exists, is a parameter, shape,
    dtype, the same tied owners, one device per buffer) before anything is copied.

    >>> import torch
    >>> from yafsdp_cli import LayoutOptions, convert_module, plan, spec_from_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> flat = convert_module(model, plan(spec_from_module(model), LayoutOptions(world_size=2)))
    >>> [tuple(p.shape) for p in flat.parameters()]  # one flat buffer, padded
    [(32,)]
    >>> list(model.state_dict())  # the module keeps its names
    ['0.weight', '0.bias', '1.weight', '1.bias']
    >>> model = flat.restore()
    """
    if HANDLE_ATTR in module.__dict__:
        raise ConversionError("this module is converted already; restore() it first")
    items = {i.names[0]: i for i in collect_tensors(module)}
    for b in layout.buffers:
        _check_buffer_against_module(b, items)
    buffers = [_build_buffer(b, items) for b in layout.buffers]
    return FlatModel(module, layout, buffers)


def _check_buffer_against_module(b: BufferLayout, items) -> None:
    devices = set()
    for e in b.entries:
        item = items.get(e.name)
        if item is None or not item.is_param:
            what = "no parameter" if item is None else "a buffer, not a parameter"
            raise ConversionError(f"layout entry {e.name!r} is {what} in this module")
        t = item.tensor
        if tuple(t.shape) != e.shape or dtypes.from_torch(t.dtype) != e.dtype:
            raise ConversionError(
                f"{e.name}: module has {tuple(t.shape)} {t.dtype}, layout says {e.shape} {e.dtype}"
            )
        if tuple(item.names[1:]) != e.aliases:
            raise ConversionError(
                f"{e.name}: module ties it to {item.names[1:]}, layout says {list(e.aliases)}"
            )
        devices.add(t.device)
    if len(devices) > 1:
        raise ConversionError(
            f"{b.name}: parameters on several devices {sorted(map(str, devices))}"
        )


def _build_buffer(b: BufferLayout, items) -> FlatBuffer:
    first = items[b.entries[0].name].tensor if b.entries else None
    device = first.device if first is not None else "cpu"
    data = torch.zeros(b.padded_numel, dtype=dtypes.to_torch(b.dtype), device=device)
    params, owners = [], []
    for e in b.entries:
        item = items[e.name]
        with torch.no_grad():
            data.narrow(0, e.offset, e.numel).copy_(item.tensor.reshape(-1))
        params.append(item.tensor)
        # A module registered under two names is one owner, not two.
        owners.append(list({(id(m), a): (m, a) for m, a in item.owners}.values()))
    buffer = FlatBuffer(b, nn.Parameter(data, requires_grad=b.requires_grad), params, owners)
    buffer.point_params()
    return buffer
