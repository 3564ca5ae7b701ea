"""``plan --scheme`` output: the schemes side by side (one column each) as a Rich
table, markdown, JSON and HTML; ``plan_view`` calls these where the report carries
schemes."""

from __future__ import annotations

from ..planning import PlanReport
from ..schemes import FLAT
from .formatting import Section, human_bytes, markdown_table, plain


def payload(report: PlanReport) -> list[dict]:
    """The ``schemes`` key of ``yafsdp.plan/1``: every field, in bytes; the cell
    compared at as ``[world size, micro-batch, checkpointing]``."""
    out = []
    for s in report.schemes:
        doc = {**plain(s), "flat_saves_percent": s.flat_saves_percent}
        at = s.compared_at
        doc["compared_at"] = None if at is None else [at.world_size, *at.choice]
        out.append(doc)
    return out


def side_by_side(report: PlanReport) -> Section:
    schemes = report.schemes
    several = len(report.checkpointing) > 1  # else every cell has the one choice
    rows: list[tuple[str, ...]] = []
    for i, mb in enumerate(report.micro_batches):
        label = f"fewest GPUs, micro-batch {mb}"
        rows.append((label, *(_smallest(s.smallest[i], several) for s in schemes)))
    rows.append(("best configuration", *(_where(s.best, several) for s in schemes)))
    rows.append(("peak at best", *(_peak(s.best) for s in schemes)))
    rows.append(("needed at best", *(_needed(s.best) for s in schemes)))
    rows.append(("flat saves at the peak", *(_saves(s) for s in schemes)))
    rows.append(("rows", *(_measured(s) for s in schemes)))
    return Section(
        title="Schemes side by side: peak per rank of one training step",
        headers=("", *(s.scheme.name for s in schemes)),
        rows=tuple(rows),
        right=tuple(range(1, len(schemes) + 1)),
        caption=_caption(report),
    )


def settings_lines(report: PlanReport) -> list[str]:
    """What each scheme's rows assume and how they were had, one line each."""
    return [f"{s.scheme.name}: {_settings(s)}; {s.method}" for s in report.schemes]


def spread_lines(report: PlanReport) -> list[str]:
    """Each cell whose ranks peak apart, one line: every rank group's peak and the
    spread between the fullest and the emptiest (the row shows the fullest)."""
    lines = []
    for s in report.schemes:
        for r in s.rows:
            if not r.rank_spread_bytes:
                continue
            groups = ", ".join(f"{_ranks(g)} {human_bytes(g.peak_bytes)}" for g in r.ranks)
            lines.append(
                f"{s.scheme.name}, world size {r.world_size}, micro-batch {r.micro_batch}, "
                f"{r.checkpointing}: ranks peak apart by {human_bytes(r.rank_spread_bytes)}: "
                f"{groups}"
            )
    return lines


def _ranks(g) -> str:
    return f"rank {g.first}" if g.first == g.last else f"ranks {g.first}-{g.last}"


def _measured(s) -> str:
    if s.modelled:
        return "modelled"
    return "flat steps" if s.scheme is FLAT else "engine run"


def _smallest(s, several: bool) -> str:
    if s.world_size is None:
        return "none fits"
    return f"{s.world_size} ({s.checkpointing})" if several else str(s.world_size)


def _where(row, several: bool) -> str:
    if row is None:
        return "nothing fits"
    where = f"{row.world_size} x micro-batch {row.micro_batch}"
    return f"{where}, {row.checkpointing}" if several else where


def _peak(row) -> str:
    if row is None:
        return "-"
    return f"{human_bytes(row.peak_bytes)} ({row.peak_phase})"


def _needed(row) -> str:
    return "-" if row is None else human_bytes(row.needed_bytes)


def _settings(s) -> str:
    text = s.configuration
    if s.no_reshard_peak_bytes is not None:
        verdict = "fits" if s.no_reshard_fits else "OOM"
        text += (
            f" (with False, every unit kept gathered, the best configuration "
            f"peaks at {human_bytes(s.no_reshard_peak_bytes)}: {verdict})"
        )
    if s.no_sync_peak_bytes is not None:
        verdict = "fits" if s.no_sync_fits else "OOM"
        text += (
            "; gradient sync every micro-batch (with set_requires_gradient_sync(False) until "
            "the last, every gradient held unsharded, the best configuration peaks at "
            f"{human_bytes(s.no_sync_peak_bytes)}: {verdict})"
        )
    return text


def _saves(s) -> str:
    if s.scheme is FLAT or s.flat_saves_bytes is None:
        return "-"
    return f"{human_bytes(s.flat_saves_bytes)} ({s.flat_saves_percent:.1f}%)"


def _caption(report: PlanReport) -> str:
    return (
        "peak per rank of the fullest rank (the one that needs the most): rows 'engine run' "
        "are the engine's own fake step (FakeTensorMode, a fake process group, every rank; "
        "--explain: where ranks differ), 'flat steps' the plan's own cells; rows "
        "'modelled' are not run: the scheme's persistent bytes per rank + its gathered "
        "parameters and gradient buffers + the flat step's activations and temporaries; "
        "flat saves: "
        "the scheme's peak minus the flat scheme's at the scheme's best configuration "
        "(the flat scheme's best where nothing of the scheme fits; negative: the flat "
        "scheme needs more); needed: the peak + the caching allocator's fragmentation (the "
        "step's own replay; a modelled row takes the flat step's at that cell) + what a "
        "rank holds beside the allocator; fits: "
        f"needed <= {human_bytes(report.gpu_memory_bytes)}, the best keeping "
        f"{human_bytes(report.margin_bytes)} free; best configuration: the most tokens per "
        "rank that fits so, then no checkpointing, then the fewest GPUs" + _ranked_apart(report)
    )


def _ranked_apart(report: PlanReport) -> str:
    """Where the answer ranks by speed, that the table's best rows do not."""
    t = report.timing
    if t is None:
        return ""
    return f"; the answer above ranks by {t.objective} on {t.gpu} instead"


def to_markdown(report: PlanReport) -> list[str]:
    if not report.schemes:
        return []
    s = side_by_side(report)
    settings = [f"- {line}" for line in (*settings_lines(report), *spread_lines(report))]
    return [
        f"**{s.title}**",
        "",
        markdown_table(s.headers, s.rows),
        "",
        s.caption,
        "",
        *settings,
        "",
    ]


def to_rich(report: PlanReport, explain: bool = False) -> list:
    """The table and each scheme's settings; with ``explain``, every cell whose ranks
    differ (else a pointer to them)."""
    if not report.schemes:
        return []
    from rich.text import Text

    from .formatting import section_table

    table = section_table(side_by_side(report), fold_names=False)
    lines = settings_lines(report)
    spread = spread_lines(report)
    if explain:
        lines += spread
    elif spread:
        lines.append(f"ranks differ in {len(spread)} cells: --explain")
    return [table, *(Text(f"  {line}") for line in lines)]


def to_html(report: PlanReport) -> str:
    if not report.schemes:
        return ""
    from .html_base import notes_html, section_html

    settings = notes_html("scheme settings", [*settings_lines(report), *spread_lines(report)])
    return section_html(side_by_side(report)) + settings
