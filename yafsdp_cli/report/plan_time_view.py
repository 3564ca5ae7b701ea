"""The step-time columns of ``yafsdp plan``: the cells that fit, best first by the
plan's objective, with step time, tokens/s per GPU, MFU and exposed communication."""

from __future__ import annotations

from ..planning import PlanReport, PlanRow
from ..planning.cell_time import ranked_rows
from .formatting import Section, human_bytes

# two-line headers: the columns stay as narrow as their figures at 80 columns
HEADERS = (
    "GPUs",
    "micro-\nbatch",
    "check-\npointing",
    "needed",
    "step",
    "tokens/s\nper GPU",
    "MFU",
    "exposed\ncomm",
)
CHECKPOINTING = 2


def time_section(report: PlanReport) -> Section | None:
    """None where the plan names no GPU. Where every listed cell checkpoints alike,
    the title names it in place of a column."""
    t = report.timing
    if t is None:
        return None
    rows = ranked_rows(report.rows, t.objective)
    title = f"How fast? The cells that fit on {t.gpu}, best first by {t.objective}"
    cells = [_cells(r) for r in rows]
    headers = HEADERS
    if len({r.checkpointing for r in rows}) == 1:
        title += f", checkpointing {rows[0].checkpointing}"
        headers = HEADERS[:CHECKPOINTING] + HEADERS[CHECKPOINTING + 1 :]
        cells = [c[:CHECKPOINTING] + c[CHECKPOINTING + 1 :] for c in cells]
    figures = range(len(headers))
    return Section(
        title=title,
        headers=headers,
        rows=tuple(cells),
        right=tuple(i for i in figures if headers[i] != HEADERS[CHECKPOINTING]),
        caption="" if rows else "nothing in the grid fits",
        key=tuple(i for i in figures if headers[i] in HEADERS[: CHECKPOINTING + 1]),
        rules=False,  # as the grid above it: eight columns fit in 80
    )


def _cells(r: PlanRow) -> tuple[str, ...]:
    t = r.time
    return (
        str(r.world_size),
        str(r.micro_batch),
        r.checkpointing,
        human_bytes(r.needed_bytes),
        seconds(t.step_s),
        f"{t.tokens_per_s:,.0f}",
        f"{t.mfu:.1%}",
        f"{t.exposed_share:.1%}",
    )


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


WHY_BEST = {  # why the best row wins under each --objective
    "throughput": "the most tokens/s per GPU that fits, to within 1%, on the fewest GPUs",
    "gpu-hours": "the fewest GPU-hours that fit, to within 1%, on the most GPUs",
    "fewest-gpus": "the fewest GPUs that fit, then the most tokens/s per GPU",
}


def best_line(report: PlanReport) -> str | None:
    """What the best row's time is and why it is best, in one line."""
    t, b = report.timing, report.best
    if t is None or b is None:
        return None
    why = WHY_BEST[t.objective]
    line = (
        f"fastest by {t.objective} on {t.gpu}: world size {b.world_size}, micro-batch "
        f"{b.micro_batch}, checkpointing {b.checkpointing} ({why}): {seconds(b.time.step_s)} "
        f"per step, {b.time.tokens_per_s:,.0f} tokens/s per GPU, MFU {b.time.mfu:.1%}, "
        f"{b.time.exposed_share:.1%} of the step in exposed communication"
    )
    if t.gpu_hours is not None:
        line += (
            f"; {t.tokens:,} tokens take {t.gpu_hours:,.0f} GPU-hours, "
            f"{t.wall_hours:,.1f} h on {b.world_size} GPUs"
        )
    return line


# each bound's words: what decides a kernel's time (``timing.roofline.BOUNDS``)
BOUND_WORDS = {
    "matrix": "products",
    "attention": "attention",
    "vector": "vector math",
    "memory": "memory",
    "floor": "launch floors",
}


def bound_line(report: PlanReport) -> str | None:
    """Where the best row's step goes: its compute by the bound that decides each
    kernel, its communication, and which of the two decides the step."""
    b = report.best
    if report.timing is None or b is None or not b.time.compute_bound_s:
        return None
    t = b.time
    compute = t.compute_s
    parts = [
        f"{BOUND_WORDS[k]} {v / compute:.0%}"
        for k, v in t.compute_bound_s.items()
        if k != "vector" or v >= 0.005 * compute
    ]
    lead = max((k for k in t.compute_bound_s if k != "floor"), key=t.compute_bound_s.get)
    if t.decided_by == "communication":
        decides = (
            f"communication decides the step: its collectives take {seconds(t.comm_s)} back "
            f"to back, longer than the {seconds(t.forward_s + t.backward_s)} of forward and "
            "backward they run behind"
        )
    else:
        decides = f"compute decides the step, {BOUND_WORDS[lead]} the most of it"
    return (
        f"where the step goes: compute {seconds(compute)} ({', '.join(parts)}); "
        f"collectives {seconds(t.comm_s)} back to back, {seconds(t.exposed_comm_s)} of them "
        f"exposed; {decides}"
    )
