"""``inspect``: a model's flat-buffer layout and per-rank memory, from any source.

``inspect_model`` plans the layout for the user's options, runs the memory model on
it and returns one frozen ``InspectReport``: what the report layer renders as
tables, markdown or the ``yafsdp.inspect/1`` JSON document. Nothing here imports
torch, so a safetensors header is inspected without it.

>>> from yafsdp_cli import ModelSpec, TensorRecord
>>> from yafsdp_cli.sources import LoadedModel
>>> spec = ModelSpec((TensorRecord("w", (1000, 8), "bfloat16"),), has_architecture=False)
>>> report = inspect_model(LoadedModel(spec=spec), world_size=4)
>>> report.params.total_numel, report.buffers[0].shard_numel
(8000, 2000)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine import dtypes
from ..engine.filters import parse_filter
from ..engine.layout import BufferLayout, FlatEntry, Layout, ShardPiece, parse_align
from ..engine.plan import plan
from ..engine.records import ModelSpec, TensorRecord, retype_params
from ..engine.units import ROOT
from ..errors import FilterError, SourceError
from ..memory.config import memory_config
from ..memory.estimate import (
    MemoryBreakdown,
    MemoryReport,
    assumptions,
    estimate_memory,
)
from ..memory.fsdp2 import RankGroup, UnevenSplit
from ..options.training_dtype import training_dtype
from ..schemes import FSDP2, Scheme
from ..sources.adapted import adapt, keeps_stored_base
from .headline import Headline, headline
from .inspect_options import InspectOptions
from .stored import StoredState, resolve_optimizer, stored_notes, stored_state

SCHEMA = "yafsdp.inspect/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class InspectInputs:
    """The options the report was computed with (``None``: the default/auto choice)."""

    source: str
    model: str | None
    filters: tuple[str, ...]
    excludes: tuple[str, ...]
    unit_globs: tuple[str, ...]  # empty: units detected
    world_size: int
    align: str
    param_dtype: str | None  # None: the stored dtypes
    grad_dtype: str | None  # None: each parameter's dtype
    optimizer: str
    master_weights: bool | None  # None: auto (on for 16-bit parameters)
    round_bytes: int
    fsdp_placement: str  # "dim0" (fully_shard's default) or "auto" (Shard(1) where better)
    freeze: tuple[str, ...] = ()  # --freeze: parameters that do not train
    lora: str | None = None  # --lora as given (the source is adapted before it is inspected)
    quantize: str | None = None  # --quantize: the frozen linear layers' packed format


@dataclass(frozen=True, slots=True)
class SharedParam:
    name: str
    aliases: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ParamSummary:
    """Parameters counted once each (a tied parameter once, under its first name)."""

    total_count: int
    total_numel: int
    total_bytes: int  # in the planned dtypes
    converted_count: int
    converted_numel: int
    unconverted_count: int
    unconverted_numel: int
    frozen_numel: int  # requires_grad=False
    shared: tuple[SharedParam, ...]
    padding_numel: int  # over every flat buffer
    padding_bytes: int
    padding_percent: float  # of the flat buffers' padded bytes


@dataclass(frozen=True, slots=True)
class ModuleBuffers:
    """Module buffers (BatchNorm statistics, rotary tables): never converted."""

    count: int
    numel: int
    bytes: int
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One flat buffer: ``entries`` live at ``flat[offset : offset + numel]``; rank r owns
    ``flat[r * shard_numel : (r + 1) * shard_numel]``."""

    name: str
    unit: str  # "" is the root unit
    dtype: str
    requires_grad: bool
    numel: int  # sum of entry numels
    padded_numel: int
    padding_numel: int
    shard_numel: int
    bytes: int  # padded
    start_align: int
    end_multiple: int
    entries: tuple[FlatEntry, ...]


@dataclass(frozen=True, slots=True)
class BufferGroup:
    """Buffers with the same layout up to their unit prefix (transformer blocks):
    indexes into ``InspectReport.buffers``, the first one shown for all."""

    members: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SchemeMemory:
    """One scheme's bytes per rank, with the savings against the DDP baseline."""

    scheme: Scheme  # JSON: its inspect_key (report.inspect_view.to_json)
    params: int
    grads: int
    optimizer: int
    master: int
    buffers: int
    gather: int
    reduce: int
    persistent: int
    total: int
    savings_bytes: int  # baseline total - this total
    savings_percent: float
    ranks: tuple[RankGroup, ...]  # distinct groups of ranks; one group where all are alike


@dataclass(frozen=True, slots=True)
class MemorySummary:
    baseline_bytes: int  # DDP, per rank
    flat_bytes: int  # yafsdp flat buffers, per rank
    savings_bytes: int  # baseline_bytes - flat_bytes
    savings_percent: float
    largest_unit: str
    largest_unit_bytes: int
    schemes: tuple[SchemeMemory, ...]  # ddp (the baseline), flat, zero2, zero3, fsdp2
    fsdp_placement: str
    fsdp_uneven: UnevenSplit | None  # FSDP2's dim-0 split is >5% above even: the remedy


@dataclass(frozen=True, slots=True)
class ShardRow:
    """What one rank owns of one buffer: ``flat[start:end]``."""

    rank: int
    start: int
    end: int
    pieces: tuple[ShardPiece, ...]
    padding_numel: int


@dataclass(frozen=True, slots=True)
class InspectReport:
    source_kind: str
    has_architecture: bool
    inputs: InspectInputs
    params: ParamSummary
    module_buffers: ModuleBuffers
    buffers: tuple[BufferInfo, ...]
    groups: tuple[BufferGroup, ...]
    units: tuple[str, ...]  # the units used, in model order ("" root not listed)
    memory: MemorySummary
    notes: tuple[str, ...]  # about the source: no architecture, tied weights...
    assumptions: tuple[str, ...]  # of the memory model and the options
    layout: Layout  # the planned layout itself, for library users
    memory_report: MemoryReport
    stored_state: StoredState | None = None  # a training checkpoint's own optimizer state
    headline: Headline | None = None  # the flat layout beside the best other scheme


def inspect_model(
    loaded, opts: InspectOptions | None = None, *, model: str | None = None
) -> InspectReport:
    """Plan ``loaded`` (a ``sources.LoadedModel``) and estimate its per-rank memory.

    ``opts`` (None: ``InspectOptions()``): the step piece's ``param_dtype`` is the
    training dtype: floating parameters are planned and counted in it whatever their
    stored dtype. ``optimizer=None`` takes the checkpoint's own (a DCP checkpoint with
    optimizer state), else AdamW. Raises ``FilterError``, ``LayoutError`` or
    ``YafsdpError`` for bad options.
    """
    opts = opts if opts is not None else InspectOptions()
    trained = training_dtype(opts.step.param_dtype, loaded.spec)
    lay, step = opts.layout, dataclasses.replace(opts.step, param_dtype=trained.dtype)
    loaded = adapt(loaded, step)  # --freeze, --lora: what trains
    if not loaded.spec.tensors:
        raise SourceError(f"{loaded.spec.source or 'the source'} holds no tensors to lay out")
    _check_architecture_filters(loaded, [*lay.filters, *lay.excludes])
    spec = retype_params(loaded.spec, step.param_dtype, keeps_stored_base(loaded))
    optimizer, decided = resolve_optimizer(loaded, step.optimizer)
    cfg = memory_config(step, opts.memory, optimizer=optimizer)
    align_spec = parse_align(lay.align)
    layout = plan(spec, lay)
    memory = estimate_memory(layout, cfg, fsdp_placement=opts.memory.fsdp_placement)
    inputs = InspectInputs(
        source=spec.source,
        model=model,
        filters=lay.filters,
        excludes=lay.excludes,
        unit_globs=lay.units or (),
        world_size=lay.world_size,
        align=align_spec.name,
        param_dtype=dtypes.canonical(step.param_dtype) if step.param_dtype else None,
        grad_dtype=cfg.grad_dtype,
        optimizer=optimizer,
        master_weights=opts.memory.master_weights,
        round_bytes=cfg.round_bytes,
        fsdp_placement=opts.memory.fsdp_placement,
        freeze=step.freeze,
        lora=step.lora,
        quantize=step.quantize,
    )
    buffers = tuple(_buffer_info(b) for b in layout.buffers)
    stored = stored_state(loaded, layout, cfg, decided)
    return InspectReport(
        source_kind=spec.source_kind,
        has_architecture=spec.has_architecture,
        inputs=inputs,
        params=_param_summary(spec, layout),
        module_buffers=_module_buffers(spec),
        buffers=buffers,
        groups=group_buffers(layout.buffers),
        units=layout.units,
        memory=_memory_summary(memory),
        notes=spec.notes + stored_notes(stored, cfg),
        assumptions=(trained.why, *assumptions(memory)),
        layout=layout,
        memory_report=memory,
        stored_state=stored,
        headline=headline(spec, lay, cfg, opts.memory.fsdp_placement, layout, memory),
    )


def _check_architecture_filters(loaded, exprs: Sequence[str]) -> None:
    """A source may know why it has no architecture (an HF folder without the
    ``hf`` extra); say that instead of the generic advice."""
    hint = getattr(loaded, "extra", {}).get("architecture_hint")
    if not hint or loaded.spec.has_architecture:
        return
    for text in exprs:
        if parse_filter(text).needs_architecture:
            raise FilterError(f"filter {text!r} needs the model's architecture: {hint}")


def _param_summary(spec: ModelSpec, layout: Layout) -> ParamSummary:
    params = spec.params
    unconverted = [t for t in layout.kept if t.is_param]
    padded = sum(b.nbytes for b in layout.buffers)
    pad_bytes = sum(b.padding * dtypes.itemsize(b.dtype) for b in layout.buffers)
    return ParamSummary(
        total_count=len(params),
        total_numel=sum(t.numel for t in params),
        total_bytes=sum(t.nbytes for t in params),
        converted_count=sum(len(b.entries) for b in layout.buffers),
        converted_numel=layout.converted_numel,
        unconverted_count=len(unconverted),
        unconverted_numel=sum(t.numel for t in unconverted),
        frozen_numel=sum(t.numel for t in params if not t.requires_grad),
        shared=tuple(SharedParam(t.name, t.aliases) for t in params if t.aliases),
        padding_numel=sum(b.padding for b in layout.buffers),
        padding_bytes=pad_bytes,
        padding_percent=100.0 * pad_bytes / padded if padded else 0.0,
    )


def _module_buffers(spec: ModelSpec) -> ModuleBuffers:
    bufs: tuple[TensorRecord, ...] = spec.buffers
    return ModuleBuffers(
        count=len(bufs),
        numel=sum(t.numel for t in bufs),
        bytes=sum(t.nbytes for t in bufs),
        names=tuple(t.name for t in bufs),
    )


def _buffer_info(b: BufferLayout) -> BufferInfo:
    return BufferInfo(
        name=b.name,
        unit=b.unit,
        dtype=b.dtype,
        requires_grad=b.requires_grad,
        numel=b.numel,
        padded_numel=b.padded_numel,
        padding_numel=b.padding,
        shard_numel=b.shard_numel,
        bytes=b.nbytes,
        start_align=b.start_align,
        end_multiple=b.end_multiple,
        entries=b.entries,
    )


def group_buffers(buffers: Sequence[BufferLayout]) -> tuple[BufferGroup, ...]:
    """Group buffers whose entries match once the unit prefix is dropped."""
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(buffers):
        groups.setdefault(_signature(b), []).append(i)
    return tuple(BufferGroup(tuple(members)) for members in groups.values())


def _signature(b: BufferLayout) -> tuple:
    if b.unit == ROOT:  # root buffers are one of a kind
        return ("root", b.name)
    cut = len(b.unit) + 1
    entries = tuple(
        (e.name[cut:], tuple(a[cut:] if a.startswith(b.unit + ".") else a for a in e.aliases))
        + (e.shape, e.offset)
        for e in b.entries
    )
    return (b.dtype, b.requires_grad, b.padded_numel, entries)


def _scheme(
    m: MemoryBreakdown, baseline: MemoryBreakdown, n: int, ranks: tuple[RankGroup, ...] = ()
) -> SchemeMemory:
    saved = baseline.total - m.total
    alike = RankGroup((0, n - 1), m.params, m.grads, m.optimizer, m.master, m.buffers, m.persistent)
    return SchemeMemory(
        scheme=m.scheme,
        params=m.params,
        grads=m.grads,
        optimizer=m.optimizer,
        master=m.master,
        buffers=m.buffers,
        gather=m.gather,
        reduce=m.reduce,
        persistent=m.persistent,
        total=m.total,
        savings_bytes=saved,
        savings_percent=100.0 * saved / baseline.total if baseline.total else 0.0,
        ranks=ranks or (alike,),
    )


def _memory_summary(report: MemoryReport) -> MemorySummary:
    n, base = report.world_size, report.baseline
    schemes = tuple(
        _scheme(m, base, n, report.fsdp2.ranks if m.scheme is FSDP2 else ())
        for m in (base, report.flat, *report.references)
    )
    return MemorySummary(
        baseline_bytes=report.baseline.total,
        flat_bytes=report.flat.total,
        savings_bytes=report.savings_bytes,
        savings_percent=report.savings_percent,
        largest_unit=report.largest_unit,
        largest_unit_bytes=report.largest_unit_bytes,
        schemes=schemes,
        fsdp_placement=report.fsdp2.placement,
        fsdp_uneven=report.fsdp2.uneven,
    )


def shard_rows(buffer: BufferLayout, ranks: Sequence[int]) -> tuple[ShardRow, ...]:
    """The shard map of ``buffer`` for ``ranks``: which pieces each rank owns."""
    rows = []
    s = buffer.shard_numel
    for r in ranks:
        pieces = buffer.shard(r)
        covered = sum(p.end - p.start for p in pieces)
        rows.append(ShardRow(r, r * s, (r + 1) * s, pieces, s - covered))
    return tuple(rows)
