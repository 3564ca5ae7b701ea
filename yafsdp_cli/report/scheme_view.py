"""``plan --scheme`` output: the schemes side by side (one column each) as a Rich
table, markdown, JSON and HTML; ``plan_view`` calls these where the report carries
schemes."""

from __future__ import annotations

from ..planning import PlanReport
from .formatting import Section, human_bytes, markdown_table, plain


def payload(report: PlanReport) -> list[dict]:
    """The ``schemes`` key of ``yafsdp.plan/1``: every field, in bytes."""
    return [{**plain(s), "flat_saves_percent": s.flat_saves_percent} for s in report.schemes]


def side_by_side(report: PlanReport) -> Section:
    schemes = report.schemes
    rows: list[tuple[str, ...]] = []
    for i, mb in enumerate(report.micro_batches):
        label = f"fewest GPUs, micro-batch {mb}"
        rows.append((label, *(_smallest(s.smallest[i]) for s in schemes)))
    rows.append(("best configuration", *(_where(s.best) for s in schemes)))
    rows.append(("peak at best", *(_peak(s.best) for s in schemes)))
    rows.append(("settings", *(_settings(s) for s in schemes)))
    rows.append(("flat saves at the peak", *(_saves(s) for s in schemes)))
    return Section(
        title="Schemes side by side: peak per rank of one training step",
        headers=("", *(s.scheme for s in schemes)),
        rows=tuple(rows),
        right=tuple(range(1, len(schemes) + 1)),
        caption=_caption(report),
    )


def _smallest(s) -> str:
    if s.world_size is None:
        return "none fits"
    return f"{s.world_size} ({s.checkpointing})"


def _where(row) -> str:
    if row is None:
        return "nothing fits"
    return f"{row.world_size} GPUs, micro-batch {row.micro_batch}, {row.checkpointing}"


def _peak(row) -> str:
    if row is None:
        return "-"
    return f"{human_bytes(row.peak_bytes)} ({row.peak_phase})"


def _settings(s) -> str:
    if s.no_reshard_peak_bytes is None:
        return s.configuration
    verdict = "fits" if s.no_reshard_fits else "OOM"
    return f"{s.configuration}; False at best: {human_bytes(s.no_reshard_peak_bytes)} {verdict}"


def _saves(s) -> str:
    if s.flat_saves_bytes is None or s.compared_at is None:
        return "-"
    if s.scheme == "flat":
        return "-"
    return f"{human_bytes(s.flat_saves_bytes)} ({s.flat_saves_percent:.1f}%)"


def _caption(report: PlanReport) -> str:
    return (
        "peak = the scheme's persistent bytes per rank + its gathered parameters and "
        "gradient buffers + the step's activations and temporaries (fake runs); flat saves: "
        "the scheme's peak minus the flat scheme's at the scheme's best configuration "
        "(the flat scheme's best where nothing of the scheme fits); fits: peak + "
        f"{human_bytes(report.reserve_bytes)} reserve <= {human_bytes(report.gpu_memory_bytes)}"
    )


def to_markdown(report: PlanReport) -> list[str]:
    if not report.schemes:
        return []
    s = side_by_side(report)
    return [f"**{s.title}**", "", markdown_table(s.headers, s.rows), "", s.caption, ""]


def to_rich(report: PlanReport) -> list:
    if not report.schemes:
        return []
    from .formatting import section_table

    return [section_table(side_by_side(report), fold_names=False)]


def to_html(report: PlanReport) -> str:
    if not report.schemes:
        return ""
    from .html_base import section_html

    return section_html(side_by_side(report))
