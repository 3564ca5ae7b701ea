"""Rendering a ``ProfileReport``: peak bytes by category, original beside converted.

Nothing is computed here beyond differences of figures the report holds.
"""

from __future__ import annotations

from ..profiling import CATEGORIES, SCHEMA, ProfileReport, StepProfile
from .formatting import (
    AnswerText,
    answer_markdown,
    human_bytes,
    json_document,
    section_markdown,
)
from .verify_view import Section, rich_sections

LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "temporaries": "temporaries",
    "buffers": "module buffers",
}


def to_json(report: ProfileReport) -> str:
    """One ``yafsdp.profile/1`` document: every field of the report, in bytes."""
    return json_document(
        SCHEMA,
        {
            "source": report.source,
            "fake": report.fake,
            "device": report.device,
            "target": report.target,
            "world_size": report.world_size,
            "optimizer": report.optimizer,
            "optimizer_impl": report.optimizer_impl,
            "checkpointing": report.checkpointing,
            "loss": report.loss,
            "loss_detail": report.loss_detail,
            "grad_accum": report.grad_accum,
            "inputs": report.inputs,
            "round_bytes": report.round_bytes,
            "flat_buffers": report.flat_buffers,
            "converted_params": report.converted,
            "kept_params": report.kept,
            "original": _step_json(report.original),
            "converted": _step_json(report.converted_step),
            "saving_bytes": report.saving_bytes,
            "kernels": report.kernels,
            "outside": _outside_json(report),
            "notes": report.notes,
            "training_dtype": report.training_dtype,
            "trace": _trace_json(report),
        },
    )


def _trace_json(report: ProfileReport) -> dict | None:
    """How the steps were had: one period of the layer stack traced, checked and
    repeated (``periodic``), or every layer traced, and why."""
    how = report.trace
    if how is None:
        return None
    return {"periodic": how.periodic, "traced_layers": list(how.traced_layers), "why": how.why}


def _step_json(s: StepProfile) -> dict:
    return {
        "peak_bytes": s.peak.total,
        "peak": s.peak,
        "peak_phase": s.peak_phase,
        "peak_micro_batch": s.peak_micro_batch,
        "phase_peaks": s.phase_peaks,
        "phase_micro_batches": s.phase_micro_batches,
        "micro_batches": s.micro,
        "end_of_step": s.end,
        "modules": s.modules,
        "peak_modules": s.peak_modules,
        "cuda": s.cuda,
        "ops": s.ops,
        "wall_s": round(s.wall_s, 4),
        "series": s.series,
        "reserved": s.reserved,
    }


def _outside_json(report: ProfileReport) -> dict | None:
    if report.outside is None:
        return None
    return {"parts": report.outside.parts, "total_bytes": report.outside.total}


def sections(report: ProfileReport) -> list[Section]:
    out = [summary_section(report), peak_section(report)]
    if report.outside is not None:
        out.append(outside_section(report))
    if report.original.modules or report.converted_step.modules:
        out.append(module_section(report))
    for step in (report.original, report.converted_step):
        if step.peak_modules:
            out.append(peak_module_section(step))
    return out


def summary_section(report: ProfileReport) -> Section:
    mode = "fake tensors (no memory used)" if report.fake else f"real tensors on {report.device}"
    run = "1 process" if report.world_size == 1 else f"rank 0 of {report.world_size}"
    kernels = report.target
    if report.target != report.device:
        kernels += " (substituted at dispatch: no GPU here)"
    ckpt = (
        ""
        if report.checkpointing == "none"
        else f"; activation checkpointing {report.checkpointing}"
    )
    rows = (
        ("source", report.source),
        ("run", f"{mode}; converted as {run}"),
        ("kernels", kernels),
        ("inputs", report.inputs),
        (
            "step",
            f"{_passes(report)} {report.optimizer} ({report.optimizer_impl}) step{ckpt}",
        ),
        ("loss", report.loss_detail or report.loss),
        (
            "converted",
            f"{report.converted} parameters in {report.flat_buffers} flat buffers, "
            f"{report.kept} kept",
        ),
    )
    return Section("yafsdp profile", ("", ""), rows)


def _passes(report: ProfileReport) -> str:
    n = report.grad_accum
    if n == 1:
        return "forward, backward,"
    return f"{n} micro-batches (forward, backward each; gradients accumulated), then one"


def peak_where(report: ProfileReport, step: StepProfile) -> str:
    """``backward``, or with --grad-accum ``backward of micro-batch 2 of 5``."""
    if report.grad_accum == 1 or step.peak_phase == "optimizer":
        return step.peak_phase
    return f"{step.peak_phase} of micro-batch {step.peak_micro_batch} of {report.grad_accum}"


def peak_section(report: ProfileReport) -> Section:
    o, c = report.original, report.converted_step
    rows = [
        (
            LABELS[k],
            human_bytes(getattr(o.peak, k)),
            human_bytes(getattr(c.peak, k)),
            _delta(getattr(c.peak, k) - getattr(o.peak, k)),
        )
        for k in CATEGORIES
    ]
    rows.append(
        (
            "peak",
            human_bytes(o.peak.total),
            human_bytes(c.peak.total),
            _delta(c.peak.total - o.peak.total),
        )
    )
    rows.append(("peak in", peak_where(report, o), peak_where(report, c), ""))
    for phase in ("forward", "backward", "optimizer"):
        rows.append(
            (
                f"{phase} peak",
                human_bytes(o.phase_peaks.get(phase, 0)),
                human_bytes(c.phase_peaks.get(phase, 0)),
                "",
            )
        )
    rows.append(
        (
            "after the step",
            human_bytes(o.end.total),
            human_bytes(c.end.total),
            _delta(c.end.total - o.end.total),
        )
    )
    if o.cuda and c.cuda:
        rows.append(
            (
                "CUDA allocated peak",
                human_bytes(o.cuda.allocated_peak),
                human_bytes(c.cuda.allocated_peak),
                "",
            )
        )
        rows.append(
            (
                "CUDA reserved peak",
                human_bytes(o.cuda.reserved_peak),
                human_bytes(c.cuda.reserved_peak),
                "",
            )
        )
    rows.extend(_reserved_rows(o, c))
    caption = (
        "bytes alive at each step's peak, by what they are (they sum to the peak); "
        f"storages rounded to {report.round_bytes} B"
    )
    if o.reserved and c.reserved:
        caption += (
            f"; reserved: the step replayed through CUDA's caching allocator "
            f"({o.reserved.alloc_conf}), fragmentation: reserved less allocated at that peak"
        )
    return Section(
        "Peak memory of one training step",
        ("", "original", "converted", "change"),
        tuple(rows),
        right=(1, 2, 3),
        caption=caption,
    )


def _reserved_rows(o: StepProfile, c: StepProfile) -> list[tuple[str, str, str, str]]:
    if not (o.reserved and c.reserved):
        return []
    rows = []
    for label, field in (
        ("reserved peak (predicted)", "reserved_peak"),
        ("fragmentation at that peak", "fragmentation"),
        ("outside the allocator", "outside_bytes"),
        ("GPU must hold (reserved + outside)", "gpu_bytes"),
    ):
        a, b = getattr(o.reserved, field), getattr(c.reserved, field)
        rows.append((label, human_bytes(a), human_bytes(b), _delta(b - a)))
    return rows


def outside_section(report: ProfileReport) -> Section:
    """The memory a GPU holds beside the caching allocator, part by part."""
    parts = report.outside.parts
    rows = tuple((p.name, human_bytes(p.bytes), p.source) for p in parts)
    rows += (("total", human_bytes(report.outside.total), "the same for both steps"),)
    return Section(
        "Outside the caching allocator",
        ("part", "bytes", "from"),
        rows,
        right=(1,),
        caption="added to each step's predicted reserved peak: what the GPU must hold",
    )


def module_section(report: ProfileReport) -> Section:
    conv = {m.name: m for m in report.converted_step.modules}
    rows = []
    for m in report.original.modules:
        c = conv.get(m.name)
        rows.append(
            (
                m.name,
                human_bytes(m.saved),
                human_bytes(m.forward_peak),
                human_bytes(m.backward_peak),
                human_bytes(c.forward_peak) if c else "-",
                human_bytes(c.backward_peak) if c else "-",
            )
        )
    headers = ("module", "saved for bw", "fwd peak", "bw peak", "conv fwd peak", "conv bw peak")
    caption = (
        "saved for bw: bytes its forward made that were still alive when backward began "
        "(original); peaks: the most alive while it ran"
    )
    right = (1, 2, 3, 4, 5)
    return Section("Per module", headers, tuple(rows), right=right, caption=caption, names=(0,))


def peak_module_section(step: StepProfile) -> Section:
    rows = tuple(
        (m.name, m.kind, str(m.count), human_bytes(m.bytes), _share(m.bytes, step.peak.total))
        for m in step.peak_modules
    )
    listed = sum(m.bytes for m in step.peak_modules)
    caption = (
        "activations alive at the peak, by the innermost module whose forward made them; "
        "modules that differ only by index are one row; "
        f"{human_bytes(step.peak.activations - listed)} of the peak's activations are "
        "elsewhere (other modules, the batch, the loss)"
    )
    return Section(
        f"Peak by module ({step.variant})",
        ("module", "kind", "modules", "activations", "of the peak"),
        rows,
        right=(2, 3, 4),
        caption=caption,
        names=(0,),
    )


def _share(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"


def _delta(n: int) -> str:
    if n == 0:
        return "="
    return ("+" if n > 0 else "-") + human_bytes(abs(n))


def verdict(report: ProfileReport) -> str:
    o, c = report.original.peak.total, report.converted_step.peak.total
    if c <= o:
        pct = 100.0 * (o - c) / o if o else 0.0
        return (
            f"converted peak {human_bytes(c)}: {human_bytes(o - c)} ({pct:.1f}%) below the original"
        )
    return f"converted peak {human_bytes(c)}: {human_bytes(c - o)} above the original"


def answer(report: ProfileReport) -> list[str]:
    """The report's answer in at most five lines, before any table: the verdict,
    both peaks, what the GPU must hold where that is known, and the assumptions."""
    o, c = report.original, report.converted_step
    rank = f"rank 0 of {report.world_size}" if report.world_size > 1 else "1 process"
    lines = [
        verdict(report),
        f"peak: original {human_bytes(o.peak.total)} in {peak_where(report, o)}, converted "
        f"{human_bytes(c.peak.total)} in {peak_where(report, c)}",
    ]
    if o.reserved and c.reserved:
        lines.append(
            f"needed (reserved + outside): original "
            f"{human_bytes(o.reserved.gpu_bytes)}, converted {human_bytes(c.reserved.gpu_bytes)}"
        )
    run = "fake tensors" if report.fake else f"real tensors on {report.device}"
    lines.append(
        f"{run}, {report.target}'s kernels, {rank}, {report.optimizer}, loss {report.loss}; "
        f"{report.inputs}"
    )
    if report.training_dtype:
        lines.append(report.training_dtype)
    return lines


CAVEAT = "estimated, not measured"  # a note about the figures themselves, never hidden


def shown_notes(notes, explain: bool) -> list[str]:
    """Every note with ``explain``; else the caveats on the figures and a pointer."""
    if explain:
        return list(notes)
    kept = [n for n in notes if n.startswith(CAVEAT)]
    hidden = len(notes) - len(kept)
    return [*kept, *([f"{hidden} more on how the step was run: --explain"] if hidden else [])]


def to_markdown(report: ProfileReport) -> str:
    parts = [answer_markdown(answer(report)), *(section_markdown(s) for s in sections(report))]
    parts += [f"- {n}" for n in report.notes]
    return "\n".join(parts) + "\n"


def peak_bars(report: ProfileReport):
    """Each step's peak as a stacked bar by category (a Rich renderable)."""
    from .bars import BarRow, StackedBars

    o, c = report.original.peak, report.converted_step.peak
    change = 100.0 * (c.total - o.total) / o.total if o.total else 0.0
    rows = (
        BarRow("original", tuple(getattr(o, k) for k in CATEGORIES)),
        BarRow("converted", tuple(getattr(c, k) for k in CATEGORIES), f"{change:+.1f}%"),
    )
    title = "peak of the step by category (one scale)"
    return StackedBars(title, tuple(LABELS[k] for k in CATEGORIES), rows)


def to_rich(report: ProfileReport, *, explain: bool = False) -> list:
    """The answer, the tables and bars, the notes, the verdict again. Notes on how
    the step was run print with ``explain``; a note that the figures are estimated,
    not measured, always does (JSON and markdown carry every note)."""
    ok = report.converted_step.peak.total <= report.original.peak.total
    out = rich_sections(sections(report), shown_notes(report.notes, explain), verdict(report), ok)
    out.insert(2, peak_bars(report))  # under the peak table
    out.insert(0, AnswerText(answer(report)))
    return out
