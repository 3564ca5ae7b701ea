"""DDP in the fake step: ``DistributedDataParallel`` around the original model, its
buckets written for the whole model.

The model is the original one in the training dtype, with float32 masters of its
16-bit parameters that the optimizer steps on (``precision.Masters``), as the
profiler's original step has it; DDP wraps it with its default buckets (25 MiB, the
first 1 MiB) and ``gradient_as_bucket_view`` as the scheme's settings say. Two stand-ins
make it run on fake tensors and a fake group, neither of which allocates:
``init_sync=False`` (the construction's check of every rank's shapes and broadcast of
the weights read the tensors' data), and a communication hook that does what DDP's
default all-reduce does to a bucket (divide it in place, all-reduce it in place) and
returns it, since the fake group's future holds no value.

The buckets are made at construction and kept, so they are storages of the whole
model, not of its layers: the step is traced with them left out (``EngineTracker.
ignore``), and the whole model's are written in afterwards, alive from the step's
start. DDP's steady state has the buckets it rebuilds once, at its second forward:
the parameters in the order their gradients became ready, cut by its own
``_compute_bucket_assignment_by_size`` at 1 MiB for the first bucket and 25 MiB
after (``dist._DEFAULT_FIRST_BUCKET_BYTES``, ``bucket_cap_mb``), one dtype each. The
order is the traced step's, each layer's parameters repeated to the model's depth
as the step's events are (``periodic``), checked against the order of the step a
period deeper where there is one; where it differs, the parameters' own order
reversed (DDP's guess before it has seen a backward); where the step was traced
whole, the traced order as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ..engine import dtypes
from ..errors import YafsdpError
from .precision import cast_params
from .timeline import SIZE

MIB = 1024**2


@dataclasses.dataclass(frozen=True, slots=True)
class DdpEngine:
    """``DistributedDataParallel`` with these settings."""

    gradient_as_bucket_view: bool = False
    bucket_cap_mb: int | None = None  # DDP's default: 25 MiB, the first bucket 1 MiB

    def cast(self, module: nn.Module, opts, keep_frozen: bool) -> None:
        cast_params(module, opts.step.param_dtype, keep_frozen=keep_frozen)

    def wrap(self, module: nn.Module, layout, opts, modes) -> _Replicated:
        return _Replicated(module, self, modes)

    def finish(self, step, loaded, opts, got, ran: dict):
        """``step`` with the whole model's buckets alive from its start; ``ran``: the
        wrapped model of each depth traced."""
        orders = {depth: r.order for depth, r in ran.items()}
        dtype = opts.step.param_dtype
        train = dtypes.to_torch(dtypes.canonical(dtype)) if dtype else None
        order = _deep_order(orders, got, loaded.module, train)
        return with_buckets(step, bucket_sizes(order, self.bucket_cap_mb), opts)


def _hook(world_size: int):
    """DDP's default all-reduce of a bucket, in place, on the fake group."""
    import torch.distributed as dist

    def allreduce(_state, bucket):
        buffer = bucket.buffer()
        buffer.div_(world_size)
        dist.all_reduce(buffer)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return allreduce


class _Replicated:
    """The model under DDP: what the step runs, and the buckets it leaves out."""

    def __init__(self, module: nn.Module, engine: DdpEngine, modes):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from .fake import entered

        self.masters = True
        self.params = list(module.parameters())
        made = _Made()
        with entered(*modes), made:  # buckets are made by factories: fake ones
            self.forward = DistributedDataParallel(
                module,
                init_sync=False,
                bucket_cap_mb=engine.bucket_cap_mb,
                gradient_as_bucket_view=engine.gradient_as_bucket_view,
            )
            sizes = {
                b.buffer().untyped_storage().nbytes()
                for b in self.forward.reducer._get_zeros_like_grad_buckets()
            }
        self.forward.register_comm_hook(None, _hook(dist.get_world_size()))
        self.buckets = [t for t in made.tensors if t.untyped_storage().nbytes() in sizes]
        self.order: list[str] = []
        self.names = {id(p): n for n, p in module.named_parameters()}

    def before(self, tracker, opt) -> None:
        tracker.ignore(self.buckets)

    @contextlib.contextmanager
    def tracking(self, tracker):
        """Record the order the parameters' gradients become ready in."""
        handles = [
            p.register_post_accumulate_grad_hook(self._ready)
            for p in self.params
            if p.requires_grad
        ]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _ready(self, p) -> None:
        self.order.append(self.names[id(p)])

    def sizes(self, tracker):
        return None


class _Made(contextlib.AbstractContextManager):
    """Every tensor an op makes while entered (DDP's construction)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        made = self.tensors = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor):
                    made.append(out)
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def bucket_sizes(params: list[tuple[int, torch.dtype]], cap_mb: int | None) -> list[int]:
    """The bytes of each bucket DDP rebuilds for parameters ``(numel, dtype)`` in the
    order their gradients became ready: its own assignment, a dtype's first bucket up
    to 1 MiB and the rest up to 25 MiB (its defaults: ``cap_mb`` None), else every
    bucket up to ``cap_mb`` MiB, as DDP takes a cap given."""
    import torch.distributed as dist
    from torch.nn.parallel.distributed import _DEFAULT_BUCKET_CAP_MB

    if not params:
        return []
    tensors = [torch.empty(n, dtype=d, device="meta") for n, d in params]
    cap = (cap_mb or _DEFAULT_BUCKET_CAP_MB) * MIB
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap, cap]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [sum(tensors[i].numel() * tensors[i].element_size() for i in b) for b in buckets]


def with_buckets(step, sizes: list[int], opts):
    """``step`` with a block of each of ``sizes`` (rounded as the step's blocks are)
    alive from its start, DDP's buckets: gradients by role."""
    from ..engine.layout import round_up
    from .profiler import _rounding

    ev = step.events
    first = len(ev.roles)
    rounding = _rounding(opts)
    made = tuple((SIZE, first + k, round_up(n, rounding)) for k, n in enumerate(sizes) if n)
    events = dataclasses.replace(
        ev,
        events=made + ev.events,
        roles=ev.roles + ("gradients",) * len(sizes),
        born=ev.born + ("setup",) * len(sizes),
        where=ev.where + ((),) * len(sizes),
        stream=ev.stream + (0,) * len(sizes),
        owners=None if ev.owners is None else ev.owners + (None,) * len(sizes),
    )
    return dataclasses.replace(step, events=events)


def _deep_order(orders: dict, got, deep: nn.Module, train_dtype) -> list:
    """``(numel, dtype)`` of the whole model's trainable parameters in the order their
    gradients became ready (see the module's docstring); ``orders``: the order of each
    depth traced (None: the whole model)."""
    from .layer_stack import find_stack

    params = dict(deep.named_parameters())
    how = got.how
    names = orders.get(None)
    if how.periodic:
        stack = find_stack(deep)
        short = orders[how.traced_layers[0]]
        check = orders.get(how.traced_layers[-1]) if len(how.traced_layers) > 1 else None
        names = repeat_order(short, stack, stack.depth)
        if check is not None and repeat_order(short, stack, stack.checked) != check:
            names = [n for n, p in reversed(params.items()) if p.requires_grad]
    out = []
    for n in names:
        p = params.get(n)
        if p is None:
            raise YafsdpError(f"DDP's ready order names {n!r}, which the model does not have")
        dtype = train_dtype if p.is_floating_point() and train_dtype is not None else p.dtype
        out.append((p.numel(), dtype))
    return out


def repeat_order(names: list[str], stack, depth: int) -> list[str]:
    """A short model's parameter names in ready order, at ``depth`` layers: the period
    after the first (``periodic``'s B) repeated, from the deepest copy down where the
    order runs from the last layer to the first, as a backward does."""
    f, p = stack.prefix, stack.period
    lo, hi = f + p, f + 2 * p
    copies = (depth - stack.traced) // p + 1
    layers = [stack.layer(n) for n in names]
    out: list[str] = []
    i = 0
    while i < len(names):
        t = layers[i]
        if t is None or not lo <= t < hi:
            late = t is not None and t >= hi
            out.append(stack.renamed(names[i], (copies - 1) * p) if late else names[i])
            i += 1
            continue
        start = i
        while i < len(names) and layers[i] is not None and lo <= layers[i] < hi:
            i += 1
        before = next((x for x in reversed(layers[:start]) if x is not None), None)
        order = range(copies)
        if before is None or before >= hi:  # from the last layer down
            order = reversed(order)
        for j in order:
            out += [stack.renamed(n, j * p) for n in names[start:i]]
    return out
