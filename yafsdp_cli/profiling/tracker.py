"""Which storages a training step allocates, when, and what each one is for.

[Note: why a dispatch mode of our own, not torch's MemTracker]
``torch.distributed._tools.mem_tracker.MemTracker`` (torch 2.13), on the sample
models and on the 70B Llama config under FakeTensorMode, 2 CPU cores:

- it files everything allocated inside ``optimizer.step()`` as optimizer state, so
  the step's temporaries count as state: on the converted sample GPT it reports
  1,564,428 B of "Optstate" at the peak where the states are 964,620 B (the rest is
  AdamW's ``denom`` of a whole flat buffer, a temporary);
- after every op it walks every module it tracks and deep-copies snapshots: a fake
  forward + backward + for-loop AdamW step of the 70B config takes 234 s (original)
  and 227 s (converted, 35 s of it the forward alone), against about 5 s for the
  same step without it;
- it needs ``reset_mod_stats()`` between steps and has no notion of our phases.

It does count the flat gradient buffer as a gradient (its grad hooks see the flat
parameter), so correctness is not the problem; the two above are. This mode is a
few dozen lines: every op's output storages become blocks with their size and
birth phase; a weakref on each storage records its free; ``resize_`` (which the
sharded runtime uses to free and refill whole buffers, and which no dispatch mode
sees) is wrapped while tracking. Roles are given at known points (parameters,
buffers and optimizer state at the start; gradients right after backward and as
each whole flat gradient is handed to the reduce-scatter; optimizer state after
the step), and a role holds for the block's whole life: the flat gradient buffer,
allocated by ``zeros_like`` inside backward, is a gradient from its first byte.
A block with no role is an activation if the forward made it, else a temporary.
The categories at the peak therefore sum to the peak by construction.

Each block also keeps the CUDA stream it was allocated on (0 where there is no
GPU: fake tensors run on none), so ``alloc_trace`` can hand the caching
allocator's model (``memory.caching_allocator``) the step as the allocator sees it.

Where the step is traced for one period of a layer stack (``periodic``), each block
also gets the layer it belongs to: the layer whose forward or backward was running
when it was made; else the layer of the op's matching input (the same position of a
foreach list, else the first owned tensor argument), so an optimizer's temporaries
follow their parameter; else none. Storages that exist before the step (parameters,
shards, masters, optimizer states) are given theirs (``own``).

Each block also remembers the modules whose forward was running when it was made;
``replay`` then gives, at the step's peak, the activation bytes alive by the
innermost of them (the module that made them), so those rows add up to the peak's
activations less what no module made (the batch, the loss).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary, weakref

from ..engine.layout import round_up
from ..memory.caching_allocator import AllocTrace
from .timeline import ENTER, EXIT, PHASE, SIZE, StepEvents, Timeline


def op_tensors(*groups) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or results: each is a Tensor, an
    optional one, or a list of them (``Tensor[]``, ``Tensor?[]``), never deeper; a
    faster walk than ``tree_flatten``, which every op of a 70B step pays for."""
    out = []
    for group in groups:
        for a in group:
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class LayerRegions:
    """Which layer of a stack is running. Forward regions nest (a checkpointed layer
    recomputes its forward inside its backward); backward ones follow each other: a
    layer's backward starts when its output's gradient is ready, and the hook that
    marks its end may fire late (once every input's gradient is in, after the
    layer below has begun), so a backward region ends where the next begins.
    ``last``: the layer whose region ended last in this phase."""

    def __init__(self):
        self.open: list[tuple[int, bool]] = []  # (layer, backward), innermost last
        self.last: int | None = None

    @property
    def inside(self) -> bool:
        return bool(self.open)

    def innermost(self) -> int | None:
        return self.open[-1][0] if self.open else None

    def context(self, fallback: int | None) -> int | None:
        if self.open:
            return self.open[-1][0]
        return self.last if self.last is not None else fallback

    def enter(self, layer: int, backward: bool) -> None:
        if backward:
            self.open = [r for r in self.open if not r[1]]
        self.open.append((layer, backward))

    def exit(self, layer: int, backward: bool) -> None:
        if (layer, backward) in self.open:
            i = len(self.open) - 1 - self.open[::-1].index((layer, backward))
            del self.open[i]
            self.last = layer

    def reset(self) -> None:
        self.open, self.last = [], None


class StorageTracker(TorchDispatchMode):
    """See the note above. Use: ``with tracker: ...``, with ``set_phase`` between
    the phases, ``assign`` for roles, ``replay()`` at the end."""

    def __init__(self, round_bytes: int = 1):
        super().__init__()
        self.round_bytes = round_bytes
        self._index = WeakIdKeyDictionary()  # storage -> block id
        self._size: list[int] = []
        self._role: list[str | None] = []
        self._born: list[str] = []
        self._where: list[tuple[str, ...]] = []  # modules whose forward made the block
        self._stream: list[int] = []  # the CUDA stream the block was allocated on
        self._streams = torch.cuda.is_available()  # else every block is on stream 0
        self._events: list[tuple] = []
        self._refs: list = []
        self._phase = "setup"
        self._active: tuple[str, ...] = ()
        self._closed = False  # frees after tracking stopped are not part of the step
        self.ops = 0
        self.first_nbytes: list[int] = []  # each block's bytes when it was first seen
        self.tags = None  # a sharded step's ``shard_sizes.ShardTags``
        # periodic tracing: layer module name -> its index in the stack (None: off)
        self.layer_of: dict[str, int] | None = None
        self._owner: list[int | None] = []  # per block, its layer
        self._regions = LayerRegions()  # which layer is running
        self.owner_clash = False  # a storage was given two layers
        # (events, ops) recorded when each micro-batch began, and when the last ended
        # (``micro_batches``: a step of N from one of fewer)
        self.micro_marks: list[tuple[int, int]] = []

    # -- recording ---------------------------------------------------------------------

    @property
    def phase(self) -> str:
        return self._phase

    def set_phase(self, phase: str) -> None:
        self._phase = phase
        self._regions.reset()  # a region a hook never closed ends with its phase
        self._events.append((PHASE, phase))

    def mark_micro_batch(self) -> None:
        """A micro-batch begins here, or (after the last) the micro-batches end."""
        self.micro_marks.append((len(self._events), self.ops))

    def enter_module(self, name: str, backward: bool) -> None:
        if not backward:
            self._active = (*self._active, name)
        if self.layer_of is not None and name in self.layer_of:
            self._regions.enter(self.layer_of[name], backward)
        self._events.append((ENTER, name, backward))

    def exit_module(self, name: str, backward: bool) -> None:
        if not backward and name in self._active:
            i = len(self._active) - 1 - self._active[::-1].index(name)
            self._active = self._active[:i] + self._active[i + 1 :]
        layer = self.layer_of.get(name) if self.layer_of is not None else None
        if layer is not None:
            self._regions.exit(layer, backward)
        self._events.append((EXIT, name, backward))

    def own(self, tensors, layer: int) -> None:
        """Give the storages of ``tensors`` (any nesting) to ``layer`` (see the note);
        unseen ones are registered as alive now."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                i = self._see(self._storage(t))
                if self._owner[i] is None:
                    self._owner[i] = layer
                elif self._owner[i] != layer:
                    self.owner_clash = True

    def owner_of(self, t: torch.Tensor) -> int | None:
        i = self._index.get(self._storage(t))
        return None if i is None else self._owner[i]

    def assign(self, tensors, role: str) -> None:
        """Give the storages of ``tensors`` (any nesting) ``role``; unseen ones are
        registered as alive now. The first role a block gets is kept."""
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                i = self._see(self._storage(t))
                if self._role[i] is None:
                    self._role[i] = role

    def _see(self, st, owner: int | None = None) -> int:
        i = self._index.get(st)
        if i is not None:
            return i
        i = len(self._size)
        self._index[st] = i
        self._size.append(0)
        inner = self._regions.innermost()
        self._owner.append(inner if inner is not None else owner)
        self._role.append(None)
        self._born.append(self._phase)
        self._where.append(self._active)
        self._stream.append(self._stream_of(st) if self._streams else 0)
        self._refs.append(weakref.ref(st, partial(self._freed, i)))
        self.first_nbytes.append(st.nbytes())
        self._resize(i, self.first_nbytes[i])
        return i

    def block(self, t: torch.Tensor) -> int:
        """The block of ``t``'s storage (registered as alive now if unseen)."""
        return self._see(self._storage(t))

    def block_of(self, t: torch.Tensor) -> int | None:
        return self._index.get(self._storage(t))

    def is_new(self, t: torch.Tensor) -> bool:
        return self._storage(t) not in self._index

    @staticmethod
    def _storage(t: torch.Tensor):
        """The storage that holds ``t``'s bytes (an engine's tracker looks through a
        wrapper tensor to its local one: ``engine_step``)."""
        return t.untyped_storage()

    @staticmethod
    def _stream_of(st) -> int:
        if st.device.type != "cuda" or not torch.cuda.is_initialized():
            return 0
        return torch.cuda.current_stream(st.device).stream_id

    def _resize(self, i: int, nbytes: int) -> None:
        size = round_up(nbytes, self.round_bytes) if nbytes else 0
        if size != self._size[i]:
            self._events.append((SIZE, i, size - self._size[i]))
            self._size[i] = size

    def _freed(self, i: int, _ref) -> None:
        if not self._closed:
            self._resize(i, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(args, kwargs, out)
        return out

    def record(self, args, kwargs, out) -> None:
        """One op's outputs: their storages, layers and shard tags."""
        self.ops += 1
        outs = op_tensors(out if isinstance(out, (list, tuple)) else (out,))
        owners = None
        if self.layer_of is not None and not self._regions.inside and self._between_layers():
            n = len(outs)
            owners = [
                self._input_owner(args, kwargs, k, n) if self.is_new(t) else None
                for k, t in enumerate(outs)
            ]
        if self.tags is not None and self.tags.inheriting:
            self.tags.inherit(args, kwargs, outs)  # registers the outputs it tags
        for k, t in enumerate(outs):
            i = self._see(self._storage(t))
            if owners is not None and owners[k] is not None and self._owner[i] is None:
                self._owner[i] = owners[k]

    def _between_layers(self) -> bool:
        """Whether a block made outside every layer now may take its inputs' layer:
        in the optimizer step, or between two layers of a pass. Before a pass reaches
        the stack and after it leaves (embedding, final norm, head, loss, and their
        backward) a block belongs to no layer though it may come from one (the last
        layer's output, the gradient the residual carries down through every layer's
        backward, the embedding's gradient from the first layer's); the gradients a
        runtime makes after the backward are given their layers (``own_grads``)."""
        last = self._regions.last
        if self._phase == "forward":
            return last is not None and last != max(self.layer_of.values())
        if self._phase == "backward":
            return last is not None and last != min(self.layer_of.values())
        return True

    def own_grads(self, params) -> None:
        """Give each parameter's gradient the parameter's layer."""
        for p in params:
            owner = self.owner_of(p)
            if owner is not None and p.grad is not None:
                self.own(p.grad, owner)

    def _input_owner(self, args, kwargs, k: int, n: int) -> int | None:
        """The layer of output ``k`` of ``n`` made outside every layer: its matching
        input's (the same position of a foreach list), else the first owned tensor's."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, (list, tuple)) and len(a) == n and isinstance(a[k], torch.Tensor):
                a = a[k]
            if isinstance(a, torch.Tensor):
                i = self._index.get(self._storage(a))
                if i is not None and self._owner[i] is not None:
                    return self._owner[i]
        return None

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            result = tracker._orig_resize(st, size)
            i = tracker._index.get(st)
            if i is not None:
                tracker._resize(i, st.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        self._closed = True
        return super().__exit__(*exc)

    # -- replay ------------------------------------------------------------------------

    def category_of(self, t: torch.Tensor) -> str | None:
        """The category of ``t``'s storage, or None if the tracker never saw it."""
        i = self._index.get(self._storage(t))
        return None if i is None else self.recorded().category(i)

    def recorded(self) -> StepEvents:
        """What was tracked, as plain data (``timeline.StepEvents``)."""
        return StepEvents(
            tuple(self._events),
            tuple(self._role),
            tuple(self._born),
            tuple(self._where),
            tuple(self._stream),
            self.ops,
            tuple(self._owner) if self.layer_of is not None else None,
        )

    def replay(self, modules_of_interest=None) -> Timeline:
        """``StepEvents.replay`` of what was tracked."""
        return self.recorded().replay(modules_of_interest)

    def alloc_trace(self) -> AllocTrace:
        """``StepEvents.alloc_trace`` of what was tracked."""
        return self.recorded().alloc_trace()
