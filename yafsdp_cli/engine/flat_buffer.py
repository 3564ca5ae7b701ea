"""One flat buffer of a converted module: its data, its gradient, its parameters' hooks.

See ``flat`` for the scheme. A ``FlatBuffer`` owns the 1-D data tensor (the flat
parameter an optimizer may step on), the original ``nn.Parameter`` objects that view
it, and the two gradient hooks of each: ``reconcile`` (a new step?) before a
backward, ``accumulate`` (a fresh gradient into its region) after ``AccumulateGrad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConversionError
from .layout import BufferLayout


class FlatBuffer:
    """One flat buffer of a converted module and the parameters that view it."""

    def __init__(self, layout: BufferLayout, param: nn.Parameter, params, owners):
        self.layout = layout
        self.param = param  # 1-D, layout.padded_numel elements; the optimizer's view
        self.params: list[nn.Parameter] = params  # per entry: the original parameter
        self.owners: list[list[tuple[nn.Module, str]]] = owners  # per entry
        self.entry_requires_grad = [p.requires_grad for p in params]
        # Weak references only: what holds gradient memory is what the user holds
        # (p.grad, the flat parameter's .grad), so dropping those frees it as it
        # frees an ordinary module's gradients.
        self._grad_ref: weakref.ref | None = None  # the flat gradient of this step
        self._views: list[weakref.ref | None] = [None] * len(params)  # p.grad we set
        self._checked = False  # reconciled in the running backward
        self._gaps_open = False  # self.grad has unwritten, uninitialized regions
        self.listeners: list[Callable[[int], None]] = []  # called as entries land
        self._hooks = [h for i in range(len(params)) for h in self._hook(i)]

    # -- views -------------------------------------------------------------------------

    def entry_tensor(self, index: int, source: torch.Tensor | None = None) -> torch.Tensor:
        """Entry ``index`` of the data (or of ``source``, e.g. the grad) as a view."""
        t = self.param.detach() if source is None else source
        e = self.layout.entries[index]
        return t.narrow(0, e.offset, e.numel).view(e.shape)

    def point_params(self) -> None:
        """Make every entry's parameter a view of its slice of ``self.param``."""
        for i, p in enumerate(self.params):
            p.data = self.entry_tensor(i)

    def check_params(self) -> None:
        """Raise if a parameter no longer views this buffer (moved or replaced)."""
        storage = self.param.untyped_storage()._cdata
        for i, (p, owners) in enumerate(zip(self.params, self.owners)):
            moved = p.untyped_storage()._cdata != storage
            replaced = next((f"{a}" for m, a in owners if m._parameters.get(a) is not p), None)
            if moved or replaced:
                what = "replaced" if replaced else "given other storage"
                raise ConversionError(
                    f"{self.layout.entries[i].name} was {what} after conversion (by .to(), "
                    "load_state_dict(assign=True) or an assignment); move or load the model "
                    "before convert_module, or restore() it first"
                )

    # -- gradients ---------------------------------------------------------------------

    def _hook(self, index: int) -> list:
        p = self.params[index]
        if not p.requires_grad:
            return []
        # The hooks hold this buffer weakly: a parameter's hooks live in autograd's C++
        # side, where the garbage collector cannot see them, so a strong reference back
        # to the buffer (which holds the parameter) would keep both alive forever. The
        # module holds its FlatModel, which holds this buffer, for as long as it trains.
        ref = weakref.ref(self)

        def before_backward(grad: torch.Tensor) -> None:
            if (buffer := ref()) is not None:
                buffer._before_backward(grad)

        def landed(_p: torch.Tensor) -> None:
            if (buffer := ref()) is not None:
                buffer._landed(index)

        return [p.register_hook(before_backward), p.register_post_accumulate_grad_hook(landed)]

    def _before_backward(self, _grad: torch.Tensor) -> None:
        if not self._checked:
            self._checked = True
            torch.autograd.Variable._execution_engine.queue_callback(self._uncheck)
            self.reconcile()

    def _uncheck(self) -> None:
        self._checked = False

    @property
    def grad(self) -> torch.Tensor | None:
        """This step's flat gradient, while anything (p.grad, the flat .grad) holds it."""
        return None if self._grad_ref is None else self._grad_ref()

    def _ours(self, index: int) -> bool:
        ref = self._views[index]
        view = None if ref is None else ref()
        return view is not None and self.params[index].grad is view

    def reconcile(self) -> None:
        """Drop the flat gradient if the user started a new step (module docstring)."""
        grad = self.grad
        if grad is None:
            return
        if self.param.grad is not grad or not any(map(self._ours, range(len(self.params)))):
            self.drop_grad()

    def drop_grad(self) -> None:
        """Forget this step's gradient: the flat one and every view of it."""
        grad = self.grad
        for i, p in enumerate(self.params):
            if self._ours(i):
                p.grad = None
        if grad is not None and self.param.grad is grad:
            self.param.grad = None
        self._grad_ref, self._views, self._gaps_open = None, [None] * len(self.params), False

    def _landed(self, index: int) -> None:
        p = self.params[index]
        if not self._ours(index):  # a fresh gradient: the first of this step
            self.accumulate(index, p.grad)
        for listener in self.listeners:
            listener(index)

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Copy a fresh gradient into entry ``index``'s region; ``p.grad`` views it."""
        flat_grad = self.grad
        if flat_grad is None:
            flat_grad = self._new_grad()
        region = self.entry_tensor(index, flat_grad)
        with torch.no_grad():
            region.copy_(grad)
        self.params[index].grad = region
        self._views[index] = weakref.ref(region)

    def _new_grad(self) -> torch.Tensor:
        self.drop_grad()  # views of an older gradient must not count as written
        try:  # zero the gaps when this backward ends; outside a backward, zero now
            torch.autograd.Variable._execution_engine.queue_callback(self.fill_gaps)
            flat_grad, self._gaps_open = torch.empty_like(self.param), True
        except RuntimeError:
            flat_grad, self._gaps_open = torch.zeros_like(self.param), False
        self.param.grad = flat_grad
        self._grad_ref = weakref.ref(flat_grad)
        return flat_grad

    def fill_gaps(self) -> None:
        """Zero the regions of ``self.grad`` that no gradient was written to."""
        grad, start = self.grad, 0
        if not self._gaps_open or grad is None:
            return
        self._gaps_open = False
        with torch.no_grad():
            for i, e in enumerate(self.layout.entries):
                if self._ours(i):
                    if e.offset > start:
                        grad[start : e.offset].zero_()
                    start = e.offset + e.numel
            if start < grad.numel():
                grad[start:].zero_()

    def padding_is_zero(self, source: torch.Tensor | None = None) -> bool:
        t = self.param.detach() if source is None else source
        start = 0
        for e in self.layout.entries:
            if t[start : e.offset].any():
                return False
            start = e.offset + e.numel
        return not bool(t[start:].any())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
