"""Rendering an ``InspectReport``: Rich tables, markdown, and the JSON document.

Every view is built from the same row builders, so the terminal and markdown say
the same thing. Long tables fold (first rows, a "... N more" line, last rows)
unless ``show_all``; buffers with the same layout (one per transformer block) are
shown once for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import dtypes
from ..inspection.build import SCHEMA, BufferInfo, InspectReport, shard_rows
from ..inspection.headline import Headline
from ..memory.estimate import GATHER_BUFFERS, REDUCE_BUFFERS
from ..schemes import DDP, FLAT, ZERO2, ZERO3, Scheme
from .formatting import (
    Section,
    answer_markdown,
    answer_text,
    human_bytes,
    human_count,
    json_document,
    plain,
    section_markdown,
    section_table,
)
from .fsdp import fsdp_sections, placement_text, warning_line

ENTRY_HEAD, ENTRY_TAIL = 16, 4  # rows shown of a folded buffer table
RANK_HEAD, RANK_TAIL = 4, 2  # ranks shown of a folded shard map
PIECES_SHOWN = 3  # pieces named per rank in a shard map
ESTIMATED = (ZERO2, ZERO3)  # the memory model's rough reference columns, starred


def header(scheme: Scheme) -> str:
    """A scheme's column header: its label, DDP marked as the baseline and the rough
    reference estimates starred."""
    if scheme is DDP:
        return f"{scheme.label} (baseline)"
    return scheme.label + ("*" if scheme in ESTIMATED else "")


# ---------------------------------------------------------------- JSON


def to_json(report: InspectReport) -> str:
    """The ``yafsdp.inspect/1`` document (see ``schemas/inspect.schema.json``).

    Shard maps are not in it: each buffer's ``shard_numel`` and entry offsets
    determine them (rank r owns ``flat[r * shard_numel : (r + 1) * shard_numel]``),
    and listing them would add tens of thousands of rows for a 70B model at world
    size 256.
    """
    return json_document(
        SCHEMA,
        {
            "source_kind": report.source_kind,
            "has_architecture": report.has_architecture,
            "inputs": report.inputs,
            "params": report.params,
            "module_buffers": report.module_buffers,
            "units": report.units,
            "buffers": report.buffers,
            "memory": _memory_json(report),
            "notes": report.notes,
            "assumptions": report.assumptions,
            "headline": _headline_json(report),
            "checkpoint_state": report.stored_state,
        },
    )


def _headline_json(report: InspectReport) -> dict:
    """The ``headline`` key, its schemes spelt as ``memory`` spells them."""
    h = report.headline
    out = plain(h)
    for row, m in zip(out["schemes"], h.schemes):
        row["scheme"] = m.scheme.inspect_key
    out["best"] = h.best.inspect_key
    return out


def _memory_json(report: InspectReport) -> dict:
    """The ``memory`` key: each scheme spelt by its ``inspect_key``, the schema's
    contract."""
    out = plain(report.memory)
    for row, s in zip(out["schemes"], report.memory.schemes):
        row["scheme"] = s.scheme.inspect_key
    return out


def payload(report: InspectReport) -> dict:
    """The JSON document as Python data (what ``to_json`` prints)."""
    import json

    return json.loads(to_json(report))


# ---------------------------------------------------------------- sections


def sections(report: InspectReport, *, show_all: bool = False) -> list[Section]:
    """Every table of the report, in display order."""
    out = [summary_section(report)]
    shown = _shown_buffers(report, show_all)
    for i, others in shown:
        out.append(buffer_section(report, i, others, show_all))
    if report.inputs.world_size > 1:
        for i, _ in shown:
            out.append(shard_section(report, i, show_all))
    out.append(memory_section(report))
    out += fsdp_sections(report)
    if report.stored_state is not None:
        out.append(stored_section(report))
    return out


def _shown_buffers(report: InspectReport, show_all: bool) -> list[tuple[int, tuple[int, ...]]]:
    """(buffer index, other buffers it stands for) for each table to show."""
    if show_all:
        return [(i, ()) for i in range(len(report.buffers))]
    return [(g.members[0], g.members[1:]) for g in report.groups]


def summary_section(report: InspectReport) -> Section:
    p, inp, mb = report.params, report.inputs, report.module_buffers
    shared = "; ".join(f"{s.name} = {', '.join(s.aliases)}" for s in p.shared) or "none found"
    converted = _percent(p.converted_numel, p.total_numel)
    rows = [
        ("source", f"{inp.source or inp.model} ({report.source_kind})"),
        ("architecture", "yes" if report.has_architecture else "no (names, shapes, dtypes only)"),
        ("parameters", f"{human_count(p.total_numel)} ({p.total_numel:,} in {p.total_count})"),
        (
            "converted",
            f"{human_count(p.converted_numel)} ({p.converted_count} tensors, {converted}) "
            f"in {len(report.buffers)} flat buffers",
        ),
        (
            "not converted",
            f"{human_count(p.unconverted_numel)} ({p.unconverted_count} tensors, kept whole)",
        ),
        ("shared (tied)", shared),
        ("module buffers", f"{mb.count} ({human_bytes(mb.bytes)}, replicated)"),
        (
            "padding",
            f"{p.padding_numel:,} elements, {human_bytes(p.padding_bytes)} "
            f"({p.padding_percent:.3f}% of the flat buffers)",
        ),
        ("units", _units_text(report.units)),
        ("world size / align", f"{inp.world_size} / {inp.align}"),
    ]
    return Section("yafsdp inspect", ("", ""), tuple(rows))


def _units_text(units: Sequence[str]) -> str:
    if not units:
        return "none: everything in the root unit"
    span = units[0] if len(units) == 1 else f"{units[0]} ... {units[-1]}"
    return f"{len(units)} ({span}) + the root unit"


def buffer_section(
    report: InspectReport, index: int, others: Sequence[int], show_all: bool
) -> Section:
    b = report.buffers[index]
    # every entry has the buffer's dtype (the layout checks it; the title names it);
    # aliases only where an entry has one: a column that says nothing costs room
    aliased = any(e.aliases for e in b.entries)
    rows = [
        (e.name, f"{e.offset:,}", f"{e.numel:,}", _shape(e.shape))
        + ((", ".join(e.aliases),) if aliased else ())
        for e in b.entries
    ]
    rows = _fold(rows, ENTRY_HEAD, ENTRY_TAIL, show_all, "entries")
    title = f"{b.name}  ({_buffer_facts(b)})"
    caption = ""
    if others:
        names = [report.buffers[i].unit or report.buffers[i].name for i in others]
        caption = f"+{len(others)} more buffers with this layout: {_span(names)} (--all shows each)"
    headers = ("entry", "offset", "numel", "shape") + (("aliases",) if aliased else ())
    return Section(title, headers, tuple(rows), right=(1, 2), caption=caption, names=(0, 4))


def _buffer_facts(b: BufferInfo) -> str:
    frozen = ", frozen" if not b.requires_grad else ""
    return (
        f"{dtypes.short(b.dtype)}{frozen}, {len(b.entries)} entries, {b.numel:,} elements, "
        f"padded to {b.padded_numel:,} (+{b.padding_numel:,}), {human_bytes(b.bytes)}"
    )


def shard_section(report: InspectReport, index: int, show_all: bool) -> Section:
    b = report.buffers[index]
    n = report.inputs.world_size
    ranks = _folded_ranks(n, show_all)
    layout_buffer = report.layout.buffers[index]
    rows: list[tuple[str, ...]] = []
    prev = -1
    for r in shard_rows(layout_buffer, ranks):
        if r.rank != prev + 1:
            rows.append(("...", "", f"{r.rank - prev - 1} more ranks (--all shows them)", ""))
        prev = r.rank
        holds = _pieces(r.pieces, b.unit)
        rows.append((str(r.rank), f"[{r.start:,}:{r.end:,}]", holds, f"{r.padding_numel:,}"))
    caption = (
        f"shard map: rank r owns flat[r * {b.shard_numel:,} : (r + 1) * {b.shard_numel:,}]"
        + ("" if not b.unit else f"; names relative to {b.unit}")
    )
    headers = ("rank", "flat slice", "holds", "padding")
    return Section(f"{b.name}: shards", headers, tuple(rows), right=(0, 3), caption=caption)


def _folded_ranks(n: int, show_all: bool) -> list[int]:
    if show_all or n <= RANK_HEAD + RANK_TAIL:
        return list(range(n))
    return [*range(RANK_HEAD), *range(n - RANK_TAIL, n)]


def _pieces(pieces, unit: str) -> str:
    def short(name: str) -> str:
        return name[len(unit) + 1 :] if unit and name.startswith(unit + ".") else name

    text = [f"{short(p.entry)}[{p.start:,}:{p.end:,}]" for p in pieces[:PIECES_SHOWN]]
    if len(pieces) > PIECES_SHOWN:
        text.append(f"... (+{len(pieces) - PIECES_SHOWN})")
    return ", ".join(text) or "(padding only)"


def memory_section(report: InspectReport) -> Section:
    m = report.memory
    schemes = m.schemes
    fields = (
        ("parameters", "params"),
        ("gradients", "grads"),
        ("optimizer states", "optimizer"),
        ("master weights", "master"),
        ("module buffers", "buffers"),
        ("persistent", "persistent"),
        ("all-gather buffers", "gather"),
        ("gradient buffers", "reduce"),
        ("total per rank", "total"),
        ("saved vs DDP", "savings_bytes"),
    )
    rows = [(label, *(human_bytes(getattr(s, f)) for s in schemes)) for label, f in fields]
    rows.append(("saved vs DDP %", *(f"{s.savings_percent:.1f}%" for s in schemes)))
    unit = m.largest_unit or "the root unit"
    caption = (
        f"largest unit: {unit}, {human_bytes(m.largest_unit_bytes)} of parameters; "
        f"FSDP2: fully_shard's fullest rank ({placement_text(m.fsdp_placement)}); "
        "* reference estimates; GiB = 1024**3"
    )
    headers = ("per rank", *(header(s.scheme) for s in schemes))
    title = f"memory per rank at world size {report.inputs.world_size}"
    right = tuple(range(1, len(headers)))
    return Section(title, headers, tuple(rows), right=right, caption=caption)


def stored_section(report: InspectReport) -> Section:
    """What a training checkpoint holds besides the weights (whole tensors)."""
    state = report.stored_state.checkpoint
    where = f"the {state.model_key!r} entry" if state.model_key else "top-level tensors"
    rows = [("weights", where, str(state.model_tensors), human_bytes(state.model_bytes), "")]
    for g in state.optimizer:
        rows.append(("optimizer", g.name, str(g.tensors), human_bytes(g.bytes), "/".join(g.dtypes)))
    for g in state.other:
        rows.append(("other", g.name, str(g.tensors), human_bytes(g.bytes), "/".join(g.dtypes)))
    kind = state.optimizer_kind or ("none" if not state.optimizer else "unrecognised")
    caption = (
        f"{state.format} checkpoint in {state.files} data file(s); optimizer: {kind}, "
        f"{state.optimizer_params} parameters; {state.non_tensor_items} pickled values not read"
    )
    headers = ("holds", "entry", "tensors", "bytes", "dtypes")
    return Section("checkpoint contents", headers, tuple(rows), right=(2, 3), caption=caption)


def answer(report: InspectReport) -> list[str]:
    """The report's answer in at most five lines, before any table: the flat layout
    beside the best other sharding scheme (``inspection.headline``) and, where it
    needs more, why; every scheme at that world size, DDP's saving among them; the
    dtype it rests on; the parameter count."""
    h, p, inp = report.headline, report.params, report.inputs
    flat, best = h.scheme(FLAT), h.scheme(h.best)
    where = f"at world size {h.world_size}"
    if not h.given:
        where += f" (one {h.world_size}-GPU node; at world size 1 nothing is sharded)"
    if h.flat_more:
        less_more = "more" if h.flat_more > 0 else "less"
        versus = f"{human_bytes(abs(h.flat_more))} {less_more} than"
    else:
        versus = "the same as"
    ddp = h.scheme(DDP)
    saved = ddp.total - flat.total
    if saved >= 0:
        change = f"flat saves {100.0 * saved / ddp.total if ddp.total else 0.0:.1f}%"
    else:
        change = f"flat needs {human_bytes(-saved)} more"
    named = [f"DDP {human_bytes(ddp.total)} ({change})"]
    rest = [m for m in h.schemes if m.scheme not in (FLAT, DDP)]
    named += [f"{header(m.scheme)} {human_bytes(m.total)}" for m in rest]
    return [
        f"{where}: yafsdp flat {human_bytes(flat.total)} per rank, {versus} "
        f"{header(h.best)} {human_bytes(best.total)}, the best other scheme",
        why_more(h) if h.flat_more > 0 else "",
        f"other schemes: {', '.join(named)}",
        f"{report.assumptions[0]}; optimizer {inp.optimizer}" if report.assumptions else "",
        f"{human_count(p.total_numel)} parameters, {p.converted_count} tensors in "
        f"{len(report.buffers)} flat buffers (* reference estimates)",
    ]


def why_more(h: Headline) -> str:
    """Where the flat layout needs more: its transient buffers, sized by its largest
    unit; and, where that is the root unit for modules outside the blocks, the
    ``--unit`` globs that give them units of their own."""
    flat, best = h.scheme(FLAT), h.scheme(h.best)
    unit = h.largest_unit or "the root unit"
    text = (
        f"why: flat keeps {GATHER_BUFFERS} all-gather and {REDUCE_BUFFERS} gradient buffers of "
        f"its largest unit (the one computing and the next, so communication overlaps "
        f"compute): {human_bytes(flat.gather + flat.reduce)} for {unit} "
        f"({human_bytes(h.largest_unit_bytes)}), {header(h.best)} "
        f"{human_bytes(best.gather + best.reduce)}"
    )
    if h.split_flat is not None:
        globs = " ".join(f"--unit '{g}'" if "*" in g else f"--unit {g}" for g in h.split_units)
        text += (
            f"; {' and '.join(h.outside)} fill that unit, outside the repeated blocks: "
            f"{globs} gives them units of their own (flat {human_bytes(h.split_flat)})"
        )
    return text


def notes(report: InspectReport) -> list[str]:
    """Everything the figures rest on: the source's notes, then the assumptions."""
    return [*report.notes, *report.assumptions]


# ---------------------------------------------------------------- helpers


def _fold(rows: list, head: int, tail: int, show_all: bool, what: str) -> list:
    if show_all or len(rows) <= head + tail + 1:
        return rows
    width = len(rows[0])
    gap = (f"... {len(rows) - head - tail} more {what} (--all shows them)",) + ("",) * (width - 1)
    return [*rows[:head], gap, *rows[-tail:]]


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "0%"


# ---------------------------------------------------------------- renderers


def to_markdown(report: InspectReport, *, show_all: bool = False) -> str:
    first = answer_markdown(answer(report), _md_escape)
    parts = [first, *(section_markdown(s, _md_escape) for s in sections(report, show_all=show_all))]
    parts.append("### Notes and assumptions\n")
    parts += [f"- {line}" for line in notes(report)]
    return "\n".join(parts) + "\n"


def _md_escape(text: str) -> str:
    """Underscores and asterisks outside words would turn into emphasis."""
    return text.replace("_", "\\_").replace("*", "\\*")


MEMORY_PARTS = (  # (SchemeMemory field, short label): the stacked categories
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer", "optimizer"),
    ("master", "master"),
    ("buffers", "buffers"),
    ("gather", "all-gather"),
    ("reduce", "grad buffers"),
)


def memory_bars(report: InspectReport):
    """The memory table as a stacked bar per scheme (a Rich renderable)."""
    from .bars import BarRow, StackedBars

    rows = tuple(
        BarRow(
            header(s.scheme),
            tuple(getattr(s, f) for f, _ in MEMORY_PARTS),
            "" if s.scheme is DDP else f"{-s.savings_percent:+.1f}%",
        )
        for s in report.memory.schemes
    )
    title = f"per rank at world size {report.inputs.world_size} (one scale; % vs DDP)"
    return StackedBars(title, tuple(label for _, label in MEMORY_PARTS), rows)


def to_rich(report: InspectReport, *, show_all: bool = False, explain: bool = False) -> list:
    """Rich renderables, in order, for a console to print; the memory table is
    followed by its bar chart. The source's notes (what could not be known from it)
    always follow; how each scheme is modelled only with ``explain`` (JSON and
    markdown always carry it)."""
    from rich.text import Text

    out: list = [answer_text(answer(report))]
    out += [section_table(s, fold_names=not show_all) for s in sections(report, show_all=show_all)]
    out.append(memory_bars(report))
    shown = notes(report) if explain else list(report.notes)
    text = Text("Notes and assumptions\n" if explain else "Notes\n", style="bold")
    for line in shown:
        text.append(f"- {line}\n")
    if not explain and report.assumptions:
        text.append(f"{len(report.assumptions)} lines on how each scheme is modelled: --explain\n")
    out.append(text)
    return out


__all__ = [
    "Section",
    "answer",
    "payload",
    "plain",
    "sections",
    "to_json",
    "to_markdown",
    "to_rich",
    "warning_line",
]
