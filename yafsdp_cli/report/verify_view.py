"""Rendering a ``VerifyReport``: the verdict, the worst tensors, each rank's memory.

Every view (Rich, markdown, JSON) is built from the same sections, so they say the
same thing; nothing is computed here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..verify.blocks import BlockChoice
from ..verify.budget import Budget
from ..verify.harness import TensorDiff, VerifyReport
from .formatting import Section, human_bytes, json_document, plain, section_markdown, section_table

SCHEMA = "yafsdp.verify/1"


def to_json(report: VerifyReport) -> str:
    """One ``yafsdp.verify/1`` document: the report's fields as they are, except that
    an infinite error (the original is 0 where the converted is not, or the tensors
    cannot be compared: see ``problem``) is ``null``."""
    return json_document(SCHEMA, {"report": finite(plain(report))})


def finite(obj):
    """JSON has no infinity: non-finite floats become None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def verdict(report: VerifyReport) -> str:
    where = f"{report.world_size} rank{'s' if report.world_size > 1 else ''}"
    if not report.reproducible:
        d = report.drift
        return (
            "NOT REPRODUCIBLE: the original model, run again from the same start under the "
            f"same settings, did not reproduce its own numbers ({d.kind} {d.name} at step "
            f"{d.step}: max abs {_num(d.max_abs)}), so the comparison with the converted "
            "model proves nothing on this machine (exit 3)"
        )
    if report.ok:
        return (
            f"OK: converted model matches the original ({report.compared} comparisons, "
            f"{report.steps} steps x {report.micro_batches} micro-batches, {where})"
        )
    parts = []
    if report.failures:
        first = report.first_failure
        parts.append(
            f"{report.failures} of {report.compared} comparisons out of tolerance; first: "
            f"{first.kind} {first.name} at step {first.step}"
            if first
            else f"{report.failures} of {report.compared} comparisons out of tolerance"
        )
    if not report.memory_ok:
        parts.append("measured per-rank memory differs from the model by more than 1%")
    return "MISMATCH: " + "; ".join(parts)


def _estimate_words(budget: Budget) -> str:
    e = budget.estimate
    act = human_bytes(e.activations) if e.activations >= 0 else "not estimated"
    parts = (
        f"parameters {human_bytes(e.params)}, gradients {human_bytes(e.grads)}, "
        f"optimizer {_optimizer_words(e)}, activations {act}, "
        f"temporaries {human_bytes(e.temporaries)}"
    )
    if e.ranks > 1:
        parts += f"; x{e.models} models on each of {e.ranks} ranks"
    return f"{human_bytes(budget.process_bytes + e.total)} ({parts})"


def _optimizer_words(e) -> str:
    if e.resident_optimizer == e.optimizer:
        return human_bytes(e.optimizer)
    return f"{human_bytes(e.optimizer)} on disk, {human_bytes(e.resident_optimizer)} at once"


def _available_words(budget: Budget) -> str:
    return f"{human_bytes(budget.available.bytes)} ({budget.available.source})"


def blocks_words(blocks: BlockChoice | None) -> str:
    if blocks is None:
        return "all"
    kept = ", ".join(map(str, blocks.kept))
    if blocks.whole:
        return f"all {blocks.total} ({blocks.why})"
    return f"{kept} of {blocks.total} in {blocks.stack} ({blocks.why})"


def header_line(budget: Budget, blocks: BlockChoice | None) -> str:
    """What the run expected, printed once it has a verdict (stderr, so --json keeps
    stdout clean)."""
    return (
        f"verify: estimated peak {_estimate_words(budget)}; available "
        f"{_available_words(budget)}; blocks: {blocks_words(blocks)}"
    )


def waiting_words(budget: Budget) -> str:
    """The waiting bar's words while the run goes on (the header line comes after it)."""
    return f"estimated peak {human_bytes(budget.estimate.total)}, running"


def refusal(budget: Budget, suggestions) -> str:
    """The one sentence of a run that cannot fit."""
    fits = "; ".join(f"{o} (about {human_bytes(b)})" for o, b in suggestions)
    return (
        f"verify needs about {_estimate_words(budget)} but only "
        f"{_available_words(budget)} is available; "
        + (f"would fit: {fits}" if fits else "no option makes it fit here")
        + ", or run it where more memory is free"
    )


def sections(report: VerifyReport) -> list[Section]:
    out = [summary_section(report), worst_section(report)]
    if report.memory:
        out.append(memory_section(report))
    return out


def summary_section(report: VerifyReport) -> Section:
    tols = ", ".join(f"{t.dtype} {_num(t.atol)}/{_num(t.rtol)}" for t in report.tolerances)
    run = f"{report.world_size} process{'es' if report.world_size > 1 else ''}"
    if report.backend:
        run += f" ({report.backend})"
    rows = (
        ("source", report.source),
        ("run", f"{run} on {report.device}"),
        ("steps", f"{report.steps} x {report.micro_batches} micro-batches, {report.optimizer}"),
        ("converted", f"{report.converted} parameters in {report.flat_buffers} flat buffers"),
        ("kept", f"{report.kept} parameters left as they were"),
        ("tolerance (atol/rtol)", tols),
        ("compared", f"{report.compared} tensors, {report.failures} out of tolerance"),
        ("blocks", blocks_words(report.blocks)),
    )
    if report.pinned:
        rows += (("numerics", report.pinned.removeprefix("pinned: ")),)
    if not report.reproducible:
        rows += (("reference", "not reproducible: the original drifted when run again"),)
    if report.budget is not None:
        rows += (
            ("estimated peak", _estimate_words(report.budget)),
            ("available", _available_words(report.budget)),
        )
    if report.peak_rss:
        largest = " (largest rank)" if report.world_size > 1 else ""
        rows += (("measured peak RSS", human_bytes(report.peak_rss) + largest),)
    return Section("yafsdp verify", ("", ""), rows)


def worst_section(report: VerifyReport) -> Section:
    rows = tuple(_diff_row(d) for d in report.worst)
    caption = "worst tensors first; max over every step"
    return Section(
        "Worst tensors",
        ("", "kind", "name", "step", "dtype", "max abs", "max rel"),
        rows,
        right=(3, 5, 6),
        caption=caption,
        names=(2,),
        key=(0, 2),
    )


def _diff_row(d: TensorDiff) -> tuple[str, ...]:
    mark = "ok" if d.ok else "FAIL"
    rel = _num(d.max_rel)
    if d.problem:
        rel = f"{rel} ({d.problem})"
    return (mark, d.kind, d.name, str(d.step), d.dtype or "-", _num(d.max_abs), rel)


def memory_section(report: VerifyReport) -> Section:
    rows = []
    for m in report.memory:
        rows.append(
            (
                str(m.rank),
                human_bytes(m.measured.params),
                human_bytes(m.measured.grads),
                human_bytes(m.measured.optimizer),
                human_bytes(m.measured.buffers),
                human_bytes(m.measured.total),
                human_bytes(m.modeled.total),
                f"{m.diff_percent:+.3f}%",
                "ok" if m.ok else "FAIL",
            )
        )
    rounding = report.memory[0].round_bytes
    caption = (
        "bytes kept between steps (after the last optimizer step), measured as the "
        "distinct storages the rank holds, beside inspect's memory model "
        f"(master weights off); allocations rounded to {rounding} B on both sides"
    )
    headers = ("rank", "params", "grads", "optim", "buffers", "held", "model", "diff", "")
    return Section(
        "Per-rank persistent memory", headers, tuple(rows), (1, 2, 3, 4, 5, 6, 7), caption
    )


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    return f"{x:.3g}"


def to_markdown(report: VerifyReport) -> str:
    return markdown_sections(sections(report), report.notes, verdict(report))


def markdown_sections(items: Sequence[Section], notes: Sequence[str], first: str) -> str:
    """A bold verdict, then each section as a heading, a table and its caption."""
    parts = [f"**{first}**", "", *(section_markdown(s) for s in items)]
    parts += [f"- {n}" for n in notes]
    return "\n".join(parts) + "\n"


def to_rich(report: VerifyReport) -> list:
    """The verdict first (the answer), the tables, the notes, and the verdict again
    under them, where a long report's reader ends up."""
    from .formatting import AnswerText

    ending = rich_sections(sections(report), report.notes, verdict(report), report.ok)
    return [AnswerText([verdict(report)]), *ending]


def rich_sections(items: Sequence[Section], notes: Sequence[str], last: str, ok: bool) -> list:
    """Rich tables for ``items``, then the notes, then ``last`` (green or red)."""
    from rich.text import Text

    out: list = [section_table(s) for s in items]
    for n in notes:
        out.append(Text(f"note: {n}"))
    out.append(Text(last, style="bold green" if ok else "bold red"))
    return out
