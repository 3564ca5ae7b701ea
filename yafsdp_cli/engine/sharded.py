"""One rank of a sharded flat-buffer model: shards persist, units gather while they run.

``ShardedFlat`` takes a converted module (``FlatModel``) and keeps, of every flat
buffer, only this rank's shard ``flat[rank * s : (rank + 1) * s]`` (``s`` is
``BufferLayout.shard_numel``) as a new 1-D parameter; the whole buffer keeps its
tensor object but its storage is resized to zero bytes. Then, per unit (the modules
that own flat buffers, the root for the root unit):

- before the unit's forward its buffers are all-gathered into their storage; after
  it they are freed again, and a hook on the unit's outputs gathers them again when
  backward reaches the unit (the root unit stays gathered through the step, as
  FSDP's root does);
- the whole buffer's gradient (the engine writes it into ``FlatBuffer.grad``)
  is reduce-scattered into the shard's ``.grad`` (added to it after the first
  micro-batch) and dropped. So with gradient accumulation a rank holds its reduced
  shards between micro-batches, never a whole gradient (as FSDP2 with gradient sync
  on: a reduce-scatter per micro-batch), and a whole unit's gradient only while its
  backward ends. ``zero_grad`` by either door (``ShardedFlat.zero_grad``, or the
  optimizer's over ``parameters()``: a shard's ``.grad`` is ``None`` or zeros) starts
  the next step from nothing. With ``LocalComm`` this happens as soon as every
  trainable entry has its gradient for this backward, and the parameters are freed
  then too: every autograd node that reads them has run, since each one produced
  one of those gradients. With ``DistComm`` it happens in ``finish_backward()``, for
  every buffer in layout order: which entries get a gradient can depend on the data
  (a mixture-of-experts router), and ranks must issue collectives in one order.
  ``finish_backward()`` also flushes buffers with entries that got no gradient,
  and frees what is still gathered;
- parameters that were not converted stay whole on every rank; their gradients
  are summed over ranks after each backward (``finish_backward``), accumulated over
  the step's micro-batches, and handed over for the optimizer step by
  ``before_step()``: from then on the parameter's ``.grad`` holds them, so the
  optimizer's ``zero_grad`` ends the step for them too.

The optimizer steps on ``parameters()``: the shards and the unconverted ones.
A rank's AdamW over its shards loads its part of a flat checkpoint and saves its
own rank file through ``checkpoint.sharded_training``.

The collectives come from a ``Comm``: ``DistComm`` (torch.distributed) sums every
reduction in rank order (an all-to-all, then a left fold) so the result does not
depend on the backend's reduction tree and equals a single-process sum in the same
order bit for bit; ``LocalComm`` stands for one rank of N in a single process and
moves no data (``profile`` uses it: memory, not values, is what it measures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..errors import ConversionError
from .flat import FlatBuffer, FlatModel


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class LocalComm:
    """Rank ``rank`` of ``world_size`` alone in this process: allocates, moves nothing."""

    simulated = True

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        s = shard.numel()
        full.zero_()  # the other ranks' slices are not here; zeros stand for them
        full.narrow(0, self.rank * s, s).copy_(shard)

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        s = full.numel() // self.world_size
        return full.narrow(0, self.rank * s, s).clone()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def any_of(self, flags: list[bool]) -> list[bool]:
        return flags


class DistComm:
    """torch.distributed collectives with every sum taken in rank order."""

    simulated = False

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        # torch 2.13 names it all_gather_single and warns on all_gather_into_tensor
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self._gather(full, shard, group=self.group)

    def reduce_scatter(self, full: torch.Tensor) -> torch.Tensor:
        # all_to_all puts rank q's slice for us at out[q * s : (q + 1) * s]
        out = torch.empty_like(full)
        self.dist.all_to_all_single(out, full, group=self.group)
        return fold(out.view(self.world_size, -1))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device)
        self._gather(parts, t.reshape(-1).contiguous(), group=self.group)
        return fold(parts.view(self.world_size, *t.shape))

    def any_of(self, flags: list[bool]) -> list[bool]:
        if not flags:
            return []
        mine = torch.tensor(flags, dtype=torch.uint8, device=_comm_device(self.dist))
        every = torch.empty(self.world_size * len(flags), dtype=torch.uint8, device=mine.device)
        self._gather(every, mine, group=self.group)
        return [bool(v) for v in every.view(self.world_size, -1).amax(0).tolist()]


def fold(parts: torch.Tensor) -> torch.Tensor:
    """``parts[0] + parts[1] + ...``, left to right (the rank order)."""
    acc = parts[0].clone()
    for q in range(1, parts.shape[0]):
        acc.add_(parts[q])
    return acc


def _comm_device(dist) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedFlat:
    """See the module docstring."""

    def __init__(
        self,
        flat: FlatModel,
        comm,
        *,
        on_reduced: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        reshard_after_forward: bool = True,
    ):
        self.flat, self.comm, self.module = flat, comm, flat.module
        # False keeps each unit gathered from its forward to the end of backward (as
        # FSDP2's reshard_after_forward=False): a torch.compile'd backward reads the
        # parameters before a per-unit hook could gather them again.
        self.reshard_after_forward = reshard_after_forward
        # sees (buffer index, whole gradient, its reduced shard) before the whole one is
        # dropped: ``profile`` names and sizes them
        self.on_reduced = on_reduced
        self.shards: list[nn.Parameter] = []
        self._gathered: set[int] = set()
        self._pending: dict[int, set[int]] = {i: set() for i in range(len(flat.buffers))}
        self._kept_acc: dict[str, torch.Tensor | None] = {}
        self._hooks = []
        for i, b in enumerate(flat.buffers):
            self.shards.append(self._make_shard(b))
            self._watch(i, b)
        # The parameters stay views of the whole buffers: they read what is gathered.
        self._install_unit_hooks()

    # -- setup -------------------------------------------------------------------------

    def _make_shard(self, b: FlatBuffer) -> nn.Parameter:
        s = b.layout.shard_numel
        data = b.param.detach().narrow(0, self.comm.rank * s, s).clone()
        free_storage(b.param)
        return nn.Parameter(data, requires_grad=b.param.requires_grad)

    def _watch(self, i: int, b: FlatBuffer) -> None:
        trainable = sum(b.entry_requires_grad)

        def landed(index: int) -> None:
            self._pending[i].add(index)
            if self.comm.simulated and len(self._pending[i]) == trainable:
                self._reduce(i)
                self._release(i)

        b.listeners.append(landed)

    def _install_unit_hooks(self) -> None:
        by_unit: dict[str, list[int]] = {}
        for i, b in enumerate(self.flat.buffers):
            by_unit.setdefault(b.layout.unit, []).append(i)
        for unit, idxs in by_unit.items():
            mod = self.module.get_submodule(unit) if unit else self.module
            if unit:
                self._check_owners(unit, mod, idxs)
            self._hooks.append(mod.register_forward_pre_hook(self._gather_hook(idxs)))
            if unit and self.reshard_after_forward:
                self._hooks.append(mod.register_forward_hook(self._after_forward_hook(idxs)))

    def _check_owners(self, unit: str, mod: nn.Module, idxs: list[int]) -> None:
        inside = {id(m) for m in mod.modules()}
        for i in idxs:
            b = self.flat.buffers[i]
            for e, owners in zip(b.layout.entries, b.owners):
                if any(id(m) not in inside for m, _ in owners):
                    raise ConversionError(
                        f"{e.name} belongs to unit {unit!r} but is also used outside it "
                        f"({', '.join(e.names)}); sharding would free it while in use: "
                        "choose --unit so tied parameters share a unit"
                    )

    def _gather_hook(self, idxs):
        # Collectives and storage resizes run eagerly, outside any torch.compile graph.
        @torch.compiler.disable
        def hook(_module, _args) -> None:
            for i in idxs:
                self.gather(i)

        return hook

    def _after_forward_hook(self, idxs):
        @torch.compiler.disable
        def hook(_module, _args, output) -> None:
            for i in idxs:
                self._release(i)
            outs = [t for t in tree_flatten(output)[0] if _wants_grad(t)]
            if outs:
                # backward reads the parameters autograd saved: gather them again
                regather = self._gather_hook(idxs)
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda _grads: regather(None, None), mode="any"
                )

        return hook

    # -- gather, reduce, release -------------------------------------------------------

    def gather(self, i: int) -> None:
        if i in self._gathered:
            return
        full = self.flat.buffers[i].param
        alloc_storage(full)
        # Refilling the storage is not a change autograd must see: the views it saved
        # for backward read the same values again (as FSDP does).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
            self.comm.all_gather(full.detach(), self.shards[i].detach())
        self._gathered.add(i)

    def _release(self, i: int) -> None:
        if i in self._gathered:
            free_storage(self.flat.buffers[i].param)
            self._gathered.discard(i)

    def _reduce(self, i: int) -> None:
        b, shard = self.flat.buffers[i], self.shards[i]
        b.fill_gaps()  # padding and entries with no gradient read as zeros
        full_grad = b.grad
        self._pending[i] = set()
        if full_grad is None:
            if self.comm.simulated or not b.layout.requires_grad:
                return
            full_grad = torch.zeros_like(b.param)  # every rank reduces every buffer
        with torch.no_grad():
            part = self.comm.reduce_scatter(full_grad)
            if self.on_reduced is not None:
                self.on_reduced(i, full_grad, part)
            if shard.grad is None:
                shard.grad = part
            else:
                shard.grad.add_(part)
        b.drop_grad()

    def finish_backward(self) -> None:
        """After each ``loss.backward()``: reduce what is left, free what is gathered."""
        for i, b in enumerate(self.flat.buffers):
            if not self.comm.simulated or self._pending[i] or b.grad is not None:
                self._reduce(i)
        for i in list(self._gathered):
            self._release(i)
        if not self.comm.simulated:
            self._reduce_kept()

    def _reduce_kept(self) -> None:
        kept = self.kept_parameters()
        flags = self.comm.any_of([p.grad is not None for _, p in kept])
        for (name, p), any_grad in zip(kept, flags):
            if not any_grad:
                continue
            local = p.grad if p.grad is not None else torch.zeros_like(p)
            total = self.comm.all_reduce(local.detach())
            acc = self._kept_acc.get(name)
            self._kept_acc[name] = total if acc is None else acc.add_(total)
            p.grad = None

    def before_step(self) -> None:
        """Give the unconverted parameters their summed gradients (N processes). They
        are handed over, not kept: the next micro-batch's sum starts from nothing,
        whichever way the step's gradients are zeroed (an optimizer's ``zero_grad``
        reaches ``p.grad`` alone)."""
        for name, p in self.kept_parameters():
            if name in self._kept_acc:
                p.grad = self._kept_acc.pop(name)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None
        self._kept_acc = {}

    # -- what the rank holds -----------------------------------------------------------

    def kept_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Unconverted parameters (whole on every rank), one per tensor."""
        return [(n, p) for n, p in self.flat.kept_parameters() if p.requires_grad]

    def parameters(self) -> list[nn.Parameter]:
        return [*self.shards, *(p for _, p in self.kept_parameters())]

    def gathered_named(self, what: str) -> dict[str, torch.Tensor | None]:
        """Every parameter name (tied names too) -> its whole value or gradient,
        all-gathered from the shards (a collective: every rank must call it)."""
        out: dict[str, torch.Tensor | None] = {}
        for b, shard in zip(self.flat.buffers, self.shards):
            src = shard.detach() if what == "param" else shard.grad
            full = None
            if src is not None:
                full = torch.empty(b.layout.padded_numel, dtype=src.dtype, device=src.device)
                self.comm.all_gather(full, src)
            for e in b.layout.entries:
                view = None if full is None else full.narrow(0, e.offset, e.numel).view(e.shape)
                for n in e.names:
                    out[n] = view
        for n, p in self.module.named_parameters(remove_duplicate=False):
            if not self.flat.is_converted(p):
                out[n] = p.detach() if what == "param" else p.grad
        return out

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def mirror_graph_breaks(module: nn.Module, layout) -> None:
    """Give an unsharded ``module`` the graph breaks ``ShardedFlat`` puts in a sharded
    one (an eager pre-hook on the root and on every unit with a flat buffer), so that
    ``torch.compile`` splits both into the same graphs and fuses the same kernels."""

    @torch.compiler.disable
    def hook(_module, _args) -> None:
        return None

    for unit in dict.fromkeys(b.unit for b in layout.buffers):
        (module.get_submodule(unit) if unit else module).register_forward_pre_hook(hook)


def _wants_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad
