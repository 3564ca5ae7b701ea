"""FSDP2 in the fake step: ``fully_shard`` on every unit, then the root, and the
blocks whose size follows the world size and the rank named as the engine makes them.

The model is the original one: every unit of the plan's layout (the repeated
blocks) gets ``fully_shard``, then the root, each with ``reshard_after_forward`` as
the scheme's settings say and ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``
where the parameters train in a 16-bit dtype: the sharded parameters are then
float32 (they are the master weights; the optimizer steps on them), frozen ones and
buffers in the training dtype (a LoRA base in its stored one, as the flat step keeps
it); the gradients reduce in ``--grad-dtype`` (the parameters' dtype where not
given). Every parameter is cut on dim 0 (FSDP2's
default placement).

Which blocks are what (``rank_sizes``' note), read from torch 2.13's
``torch/distributed/fsdp/_fully_shard``:

- before the step, each ``FSDPParam``'s ``_sharded_param_data`` (``PADDED``), its
  ``all_gather_outputs`` once made (``GATHERED``) and the optimizer's states of its
  sharded parameter (``OWN``);
- in ``foreach_all_gather`` of a unit: the all-gather input (``PADDED``, the unit's
  sum) and output (``GATHERED``, the unit's sum); in ``foreach_all_gather_copy_out``:
  each parameter's all-gather output (``GATHERED``);
- in ``foreach_reduce`` of a unit's parameters with gradients: the reduce-scatter
  input (``GATHERED``), its output and that output cast back to the sharded dtype
  (``PADDED``);
- in the optimizer step, a fresh output of the shape of the matching input (the same
  position of a foreach list) whose block is one parameter's (``OWN``).

Those three functions are looked up on ``_fsdp_param_group`` at every call, so they
are wrapped there while the step runs, and a block made inside one is named by its
size: the unit's sum, padded or gathered. A block named with a size other than its
rule's makes the step not rewritable (``RankSizes.clean``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from ..engine import dtypes
from ..engine.units import ROOT
from .precision import cast_params
from .rank_sizes import GATHERED, OWN, PADDED, RankSizes, SizeRule


@dataclasses.dataclass(frozen=True, slots=True)
class Fsdp2Engine:
    """``fully_shard`` with these settings (``memory.step_schemes.SchemeSettings``'
    FSDP2 knob)."""

    reshard_after_forward: bool = True

    def cast(self, module: nn.Module, opts, keep_frozen: bool) -> None:
        """Trainable parameters float32 where 16-bit ones keep float32 masters (FSDP2's
        sharded parameters are then the masters), the rest in the training dtype (a
        LoRA base, ``keep_frozen``, in its stored one)."""
        cast_params(module, opts.step.param_dtype, keep_frozen=keep_frozen)
        if _masters(opts):
            for p in module.parameters():
                if p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(torch.float32)

    def wrap(self, module: nn.Module, layout, opts, modes) -> _Sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (opts.layout.world_size,))  # real: outside fake mode
        kw = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        if _masters(opts):
            train = dtypes.to_torch(dtypes.canonical(opts.step.param_dtype))
            grad = opts.step.grad_dtype
            reduce = dtypes.to_torch(dtypes.canonical(grad)) if grad else train
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=train, reduce_dtype=reduce)
        for name in (u for u in layout.units if u != ROOT):
            fully_shard(module.get_submodule(name), **kw)
        fully_shard(module, **kw)
        # what the first forward does once, before the step: a fake tensor has no data
        # pointer, so its lazy init would pad an uneven shard's storage again (a real
        # one sees its own storage and keeps it), in the middle of the step
        module._get_fsdp_state()._lazy_init()
        return _Sharded(module, opts.layout.world_size)

    def finish(self, step, loaded, opts, got, ran: dict):
        return step


def _masters(opts) -> bool:
    dtype = opts.step.param_dtype
    return bool(dtype) and dtypes.itemsize(dtypes.canonical(dtype)) <= 2


def _fsdp_params(module: nn.Module) -> list:
    """Every ``FSDPParam`` of the units under ``module``, in unit order."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out += group.fsdp_params
    return out


def _term(fp) -> tuple[int, int]:
    """``(rows, elements per row)`` of a parameter as FSDP2 cuts it on dim 0."""
    if fp.fsdp_placement.dim != 0:
        raise NotImplementedError("FSDP2 sharding on a dim other than 0")
    size = tuple(fp._orig_size) or (1,)
    rows = size[0]
    return rows, (fp._orig_size.numel() // rows if rows else 0)


class _Sharded:
    """The model under ``fully_shard``: what the step runs and what it names."""

    masters = False  # the float32 sharded parameters are the masters

    def __init__(self, module: nn.Module, world_size: int):
        from torch.distributed import get_rank

        self.forward = module
        self.params = list(module.parameters())
        self.fsdp_params = _fsdp_params(module)
        self.names = Fsdp2Sizes(world_size, get_rank(), self.fsdp_params)

    def before(self, tracker, opt) -> None:
        tracker.sizes = self.names
        self.names.seed(tracker, opt)

    @contextlib.contextmanager
    def tracking(self, tracker):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        names = self.names
        saved = {n: getattr(group, n) for n in ("foreach_all_gather", "foreach_reduce")}
        copy_out = group.foreach_all_gather_copy_out
        layers = self._unit_layers(tracker)

        @contextlib.contextmanager
        def unit(fsdp_params, made_by: str):
            """What a unit's collective makes is the unit's layer's (see ``periodic``:
            prefetched, it runs in the next layer's region)."""
            tracker.making_for = layers.get(id(fsdp_params[0])) if fsdp_params else None
            try:
                with names.inside(fsdp_params, made_by):
                    yield
            finally:
                tracker.making_for = None

        def gather(fsdp_params, *args, **kwargs):
            with unit(fsdp_params, "all-gather"):
                return saved["foreach_all_gather"](fsdp_params, *args, **kwargs)

        def copied(result, fsdp_params, *args, **kwargs):
            with unit(fsdp_params, "copy-out"):
                out = copy_out(result, fsdp_params, *args, **kwargs)
            for fp in fsdp_params:
                for t in fp.all_gather_outputs:
                    rule = SizeRule(GATHERED, (_term(fp),), t.element_size(), "unsharded")
                    names.name(t, rule)
            return out

        def reduce(fsdp_params, *args, **kwargs):
            with unit(fsdp_params, "reduce-scatter"):
                return saved["foreach_reduce"](fsdp_params, *args, **kwargs)

        group.foreach_all_gather, group.foreach_reduce = gather, reduce
        group.foreach_all_gather_copy_out = copied
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(group, n, f)
            group.foreach_all_gather_copy_out = copy_out

    def _unit_layers(self, tracker) -> dict[int, int]:
        """``id(FSDPParam) -> layer`` for the units that are layers of the stack the
        tracker follows (``tracker.layer_of``)."""
        from torch.distributed.fsdp import FSDPModule

        layer_of = tracker.layer_of or {}
        out = {}
        for name, m in self.forward.named_modules():
            if name in layer_of and isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                for fp in group.fsdp_params if group is not None else ():
                    out[id(fp)] = layer_of[name]
        return out

    def sizes(self, tracker) -> RankSizes:
        return self.names.sizes(tracker.round_bytes)


class Fsdp2Sizes:
    """Names the blocks of an FSDP2 rank's step by ``rank_sizes.SizeRule`` (see the
    module's docstring)."""

    def __init__(self, world_size: int, rank: int, fsdp_params: list):
        self.world_size, self.rank = world_size, rank
        self.fsdp_params = fsdp_params
        self.tracker = None
        self.rules: dict[int, SizeRule] = {}
        self.one: dict[int, tuple[int, int]] = {}  # block -> its one parameter's term
        self.clash = False
        self.context: tuple | None = None  # (terms, kinds) while a collective runs

    def seed(self, tracker, opt) -> None:
        self.tracker = tracker
        for fp in self.fsdp_params:
            term = _term(fp)
            data = fp._sharded_param_data
            self.name(data, SizeRule(PADDED, (term,), data.element_size(), "shard"), term)
            for t in getattr(fp, "all_gather_outputs", ()):
                self.name(t, SizeRule(GATHERED, (term,), t.element_size(), "unsharded"), term)
            local = fp.sharded_param._local_tensor
            for v in (opt.state.get(fp.sharded_param, {}) if opt is not None else {}).values():
                v = getattr(v, "_local_tensor", v)
                if isinstance(v, torch.Tensor) and v.shape == local.shape and v.dim():
                    self.name(v, SizeRule(OWN, (term,), v.element_size(), "state"), term)

    def name(self, t: torch.Tensor, rule: SizeRule, term=None) -> None:
        """``t``'s storage is a block of ``rule``."""
        block = self.tracker.block(t)
        if t.untyped_storage().nbytes() != rule.numel(self.world_size, self.rank) * rule.itemsize:
            self.clash = True
        if self.rules.setdefault(block, rule) != rule:
            self.clash = True
        if term is not None:
            self.one[block] = term

    @contextlib.contextmanager
    def inside(self, fsdp_params, made_by: str):
        """While a unit's collective runs, a fresh block of the unit's size, padded or
        gathered, is named so."""
        terms = tuple(_term(fp) for fp in fsdp_params)
        self.context = (terms, made_by)
        try:
            yield
        finally:
            self.context = None

    def made(self, fresh, args, kwargs, outs, phase: str) -> None:
        """``EngineTracker.record``: an op's fresh outputs (local tensors)."""
        if self.context is not None:
            terms, made_by = self.context
            for t in fresh:
                numel = t.untyped_storage().nbytes() // t.element_size()
                for kind in (PADDED, GATHERED):
                    rule = SizeRule(kind, terms, t.element_size(), made_by)
                    if numel and numel == rule.numel(self.world_size, self.rank):
                        self.name(t, rule)
                        break
        elif phase == "optimizer":
            self._inherit(fresh, args, kwargs, outs)

    def _inherit(self, fresh, args, kwargs, outs) -> None:
        ids = {id(t) for t in fresh}
        for k, t in enumerate(outs):
            if id(t) not in ids or not t.dim():
                continue
            for x in _matching(args, kwargs, k, len(outs)):
                term = self.one.get(self.tracker.block_of(x))
                if term is not None and tuple(x.shape) == tuple(t.shape):
                    self.name(t, SizeRule(OWN, (term,), t.element_size(), "optimizer"), term)
                    break

    def sizes(self, round_bytes: int) -> RankSizes:
        return RankSizes(self.world_size, self.rank, round_bytes, dict(self.rules), not self.clash)


def _matching(args, kwargs, k: int, n: int):
    """The inputs output ``k`` of ``n`` may come from (local tensors)."""
    from .engine_step import _local

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield _local(a)
        elif isinstance(a, (list, tuple)) and len(a) == n and isinstance(a[k], torch.Tensor):
            yield _local(a[k])
