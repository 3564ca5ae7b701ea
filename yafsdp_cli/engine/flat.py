"""The conversion engine: a live module's parameters as views of flat buffers.

``convert_module`` removes the selected ``nn.Parameter``s from their modules and
copies them into one 1-D ``nn.Parameter`` per layout buffer, registered on the root
module as ``yafsdp_flat_<i>`` so ``model.parameters()`` (and so any optimizer) sees the
flat buffers. Before every forward a hook puts back, on every owner of every entry,
a view of its slice made by ``_FlatView``; its backward writes the gradient straight
into the flat buffer's ``.grad`` (no per-parameter ``.grad`` exists):

- a tied parameter is one entry with one view per forward, set on all its owners,
  so autograd sums the contributions before ``_FlatView.backward`` runs once;
- accumulation follows ``AccumulateGrad``: when the flat ``.grad`` is ``None``
  (after ``zero_grad()``, the new-step call) a buffer is allocated and each entry's
  first gradient is copied in; later gradients are added. The buffer is not zeroed
  first: what no gradient reached (padding, entries unused in this backward) is
  zeroed when the backward ends (``FlatBuffer.fill_gaps``), so a step passes over
  the gradient memory once, not twice;
- padding is never written, so it stays zero through optimizer steps;
- each owning module's own forward pre-hook makes its entries' views again, once
  per forward, just before it runs. Autograd runs ready nodes newest first, so a
  view made before the whole forward (by the root hook) would have its backward
  run last, holding every parameter's gradient until the end of backward (a whole
  model of gradients on top of the flat one); made just before use, it runs as
  soon as its gradient exists, as ``AccumulateGrad`` does. The root hook's views
  stay for parameters read outside their owner's forward.

``FlatModel.restore()`` gives back ordinary parameters, bit for bit, tied ones as
one ``nn.Parameter`` again, in their modules' original registration order.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import ConversionError
from . import dtypes
from .layout import BufferLayout, Layout
from .module_spec import collect_tensors

# Flat buffers are registered on the root module as parameters named HOLDER_<i>
# (not as a child module: nn.Sequential and others call every child).
HOLDER = "yafsdp_flat"


class _FlatView(torch.autograd.Function):
    """``flat[offset : offset + numel].view(shape)`` whose gradient goes to the buffer."""

    @staticmethod
    def forward(ctx, data: torch.Tensor, buffer: FlatBuffer, index: int) -> torch.Tensor:
        ctx.buffer, ctx.index = buffer, index
        ctx.set_materialize_grads(False)
        e = buffer.layout.entries[index]
        return data.narrow(0, e.offset, e.numel).view(e.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            ctx.buffer.accumulate(ctx.index, grad)
        return None, None, None


class FlatBuffer:
    """One flat buffer of a converted module and the owners of its entries."""

    def __init__(self, layout: BufferLayout, param: nn.Parameter, owners, requires_grad):
        self.layout = layout
        self.param = param  # 1-D, layout.padded_numel elements
        self.owners: list[list[tuple[nn.Module, str]]] = owners  # per entry
        self.entry_requires_grad: list[bool] = requires_grad  # per entry, as it was
        self._grad_ref = None  # weakref to the .grad this buffer allocated
        self._written: set[int] = set()  # entries copied into that .grad so far
        self._gaps_open = False  # that .grad has unwritten, uninitialized regions

    def view(self, index: int) -> torch.Tensor:
        if self.entry_requires_grad[index] and torch.is_grad_enabled():
            return _FlatView.apply(self.param, self, index)
        e = self.layout.entries[index]
        return self.param.detach().narrow(0, e.offset, e.numel).view(e.shape)

    def materialize(self) -> None:
        for index, owners in enumerate(self.owners):
            view = self.view(index)
            for module, attr in owners:
                setattr(module, attr, view)

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Write one entry's gradient into the flat ``.grad`` (copy first, then add)."""
        flat_grad = self.param.grad
        if flat_grad is None:
            flat_grad = self._new_grad()
        e = self.layout.entries[index]
        region = flat_grad.narrow(0, e.offset, e.numel)
        ours = self._grad_ref is not None and self._grad_ref() is flat_grad
        if ours and index not in self._written:
            region.copy_(grad.reshape(-1))
            self._written.add(index)
        else:
            region.add_(grad.reshape(-1))

    def _new_grad(self) -> torch.Tensor:
        try:  # zero the gaps when this backward ends; outside a backward, zero now
            torch.autograd.Variable._execution_engine.queue_callback(self.fill_gaps)
            flat_grad = torch.empty_like(self.param)
            self._gaps_open = True
        except RuntimeError:
            flat_grad = torch.zeros_like(self.param)
            self._gaps_open = False
        self.param.grad = flat_grad
        self._grad_ref, self._written = weakref.ref(flat_grad), set()
        return flat_grad

    def fill_gaps(self) -> None:
        """Zero the regions of the allocated ``.grad`` no gradient was written to."""
        grad = self._grad_ref() if self._grad_ref is not None else None
        if not self._gaps_open or grad is None:
            return
        self._gaps_open = False
        start = 0
        with torch.no_grad():
            for i, e in enumerate(self.layout.entries):
                if i in self._written:
                    if e.offset > start:
                        grad[start : e.offset].zero_()
                    start = e.offset + e.numel
            if start < grad.numel():
                grad[start:].zero_()

    def entry_tensor(self, index: int, source: torch.Tensor | None = None):
        """Entry ``index`` of the data (or of ``source``, e.g. the grad) as a view."""
        t = self.param.detach() if source is None else source
        e = self.layout.entries[index]
        return t.narrow(0, e.offset, e.numel).view(e.shape)

    def padding_is_zero(self, source: torch.Tensor | None = None) -> bool:
        t = self.param.detach() if source is None else source
        start = 0
        for e in self.layout.entries:
            if t[start : e.offset].any():
                return False
            start = e.offset + e.numel
        return not bool(t[start:].any())


class FlatModel:
    """Handle on a module converted in place; see the module docstring."""

    def __init__(self, module: nn.Module, layout: Layout, buffers: list[FlatBuffer], orders):
        self.module = module
        self.layout = layout
        self.buffers = buffers
        self._orders = orders  # id(module) -> (module, original _parameters keys)
        self._hook = module.register_forward_pre_hook(self._pre_forward)
        self._pass = 0  # forward passes seen by the root hook
        self._made: dict[tuple[int, int], int] = {}  # (buffer, entry) -> pass of its view
        self._owner_hooks = self._hook_owners(module)
        self._index = {
            n: (b, i) for b in buffers for i, e in enumerate(b.layout.entries) for n in e.names
        }
        self.materialize()

    def _pre_forward(self, _module, _args) -> None:
        self._pass += 1
        self.materialize()

    def _hook_owners(self, root: nn.Module) -> list:
        owned: dict[int, tuple[nn.Module, list[tuple[int, int]]]] = {}
        for bi, b in enumerate(self.buffers):
            for i, owners in enumerate(b.owners):
                for m, _ in owners:
                    owned.setdefault(id(m), (m, []))[1].append((bi, i))
        return [
            m.register_forward_pre_hook(self._owner_pre_forward(entries))
            for m, entries in owned.values()
            if m is not root
        ]

    def _owner_pre_forward(self, entries: list[tuple[int, int]]):
        def hook(_module, _args) -> None:
            for bi, i in entries:
                if self._made.get((bi, i)) == self._pass:
                    continue  # a tied entry: one view per forward, on all its owners
                self._made[(bi, i)] = self._pass
                b = self.buffers[bi]
                view = b.view(i)
                for module, attr in b.owners[i]:
                    setattr(module, attr, view)

        return hook

    def materialize(self) -> None:
        """Put fresh views on every owner; the forward hook calls this."""
        for b in self.buffers:
            b.materialize()

    def flat_parameters(self) -> Iterator[nn.Parameter]:
        return (b.param for b in self.buffers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The new-step call: reset gradient accumulation (as ``module.zero_grad``)."""
        self.module.zero_grad(set_to_none=set_to_none)

    def param(self, name: str) -> torch.Tensor:
        """The current value of a converted parameter (any tied name) as a view."""
        b, i = self._lookup(name)
        return b.entry_tensor(i)

    def grad(self, name: str) -> torch.Tensor | None:
        """The gradient of a converted parameter as a view of the flat ``.grad``."""
        b, i = self._lookup(name)
        return None if b.param.grad is None else b.entry_tensor(i, b.param.grad)

    def named_params(self) -> dict[str, torch.Tensor]:
        """Every original parameter name (tied names too) -> its current value."""
        return self._named(lambda b, i: b.entry_tensor(i), lambda p: p.detach())

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        """Every original parameter name (tied names too) -> its gradient or None."""
        return self._named(
            lambda b, i: None if b.param.grad is None else b.entry_tensor(i, b.param.grad),
            lambda p: p.grad,
        )

    def _named(self, converted, kept) -> dict:
        out = {n: converted(b, i) for n, (b, i) in self._index.items()}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if not name.startswith(HOLDER + "_"):
                out[name] = kept(p)
        return out

    def _lookup(self, name: str) -> tuple[FlatBuffer, int]:
        if name not in self._index:
            raise ConversionError(f"{name!r} is not a converted parameter")
        return self._index[name]

    def check_padding(self) -> None:
        """Raise ``ConversionError`` if padding in data or gradient is not zero."""
        for b in self.buffers:
            for what, t in (("data", b.param.detach()), ("grad", b.param.grad)):
                if t is not None and not b.padding_is_zero(t):
                    raise ConversionError(f"{b.layout.name}: padding of its {what} is not zero")

    def restore(self) -> nn.Module:
        """Give back ordinary parameters, bit for bit; the handle is dead afterwards."""
        self._hook.remove()
        for h in self._owner_hooks:
            h.remove()
        for i in range(len(self.buffers)):
            delattr(self.module, f"{HOLDER}_{i}")  # FlatBuffer.param still holds the data
        for b in self.buffers:
            for i, owners in enumerate(b.owners):
                value = b.entry_tensor(i).clone()
                p = nn.Parameter(value, requires_grad=b.entry_requires_grad[i])
                for module, attr in owners:
                    module.__dict__.pop(attr, None)
                    module._parameters[attr] = p
            b.param = None  # drop this buffer before cloning the next one
        for module, keys in self._orders.values():
            params = {k: module._parameters[k] for k in keys}
            module._parameters.clear()
            module._parameters.update(params)
        self.buffers = []
        return self.module


def convert_module(module: nn.Module, layout: Layout) -> FlatModel:
    """Convert ``module`` in place to the flat-buffer form described by ``layout``.

    Every entry is checked against the module (exists, is a parameter, shape,
    dtype, the same tied owners, one device per buffer) before anything is copied.

    >>> import torch
    >>> from yafsdp_cli import convert_module, plan, spec_from_module
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> flat = convert_module(model, plan(spec_from_module(model), world_size=2))
    >>> [tuple(p.shape) for p in model.parameters()]  # one flat buffer, padded
    [(32,)]
    >>> [name for name, _ in model.named_parameters()]
    ['yafsdp_flat_0']
    >>> model = flat.restore()
    """
    if hasattr(module, f"{HOLDER}_0"):
        raise ConversionError("this module is converted already; restore() it first")
    items = {i.names[0]: i for i in collect_tensors(module)}
    for b in layout.buffers:
        _check_buffer_against_module(b, items)
    orders = {}
    buffers = []
    for b in layout.buffers:
        buffers.append(_build_buffer(b, items, orders))
    for i, b in enumerate(buffers):
        module.register_parameter(f"{HOLDER}_{i}", b.param)
    return FlatModel(module, layout, buffers, orders)


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


def _build_buffer(b: BufferLayout, items, orders) -> FlatBuffer:
    first = items[b.entries[0].name].tensor if b.entries else None
    device = first.device if first is not None else "cpu"
    data = torch.zeros(b.padded_numel, dtype=dtypes.to_torch(b.dtype), device=device)
    owners, requires_grad = [], []
    for e in b.entries:
        item = items[e.name]
        with torch.no_grad():
            data.narrow(0, e.offset, e.numel).copy_(item.tensor.reshape(-1))
        # A module registered under two names is one owner, not two.
        unique = list({(id(m), attr): (m, attr) for m, attr in item.owners}.values())
        for module, attr in unique:
            orders.setdefault(id(module), (module, list(module._parameters)))
            del module._parameters[attr]
        owners.append(unique)
        requires_grad.append(bool(item.tensor.requires_grad))
    return FlatBuffer(b, nn.Parameter(data, requires_grad=b.requires_grad), owners, requires_grad)
