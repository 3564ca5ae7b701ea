"""The FSDP2 part of the inspect report: rank groups where ranks differ, and the
uneven-split warning with its remedy (``memory.fsdp2`` computes both)."""

from __future__ import annotations

from collections.abc import Sequence

from ..inspection.build import InspectReport, SchemeMemory
from ..schemes import FLAT, FSDP2, Scheme
from .formatting import Section, human_bytes

WHY = (
    "fully_shard cuts dim 0 with torch.chunk: every rank allocates the largest chunk "
    "for the parameter and its gradient, and the first ranks own whole rows (experts) "
    "whose optimizer states the last ranks do not hold"
)


def placement_text(placement: str) -> str:
    return "Shard(1) where better" if placement == "auto" else "Shard(0)"


def _scheme(report: InspectReport, scheme: Scheme) -> SchemeMemory:
    return next(s for s in report.memory.schemes if s.scheme is scheme)


def fsdp_sections(report: InspectReport) -> list[Section]:
    """FSDP2's rank groups (only where ranks differ), then the warning (if any)."""
    out = []
    fsdp = _scheme(report, FSDP2)
    if len(fsdp.ranks) > 1:
        out.append(ranks_section(report, fsdp))
    if report.memory.fsdp_uneven:
        out.append(uneven_section(report))
    return out


def ranks_section(report: InspectReport, fsdp: SchemeMemory) -> Section:
    rows = tuple(
        (
            _ranks(g.ranks),
            human_bytes(g.params),
            human_bytes(g.grads),
            human_bytes(g.optimizer),
            human_bytes(g.persistent),
            f"{100.0 * g.persistent / fsdp.persistent:.1f}%" if fsdp.persistent else "0%",
        )
        for g in fsdp.ranks
    )
    headers = ("ranks", "parameters", "gradients", "optimizer states", "persistent", "of fullest")
    title = f"FSDP2 per rank ({placement_text(report.memory.fsdp_placement)}): ranks differ"
    caption = (
        "parameters and gradients are padded to the largest chunk on every rank; "
        "optimizer states follow each rank's own rows"
    )
    return Section(title, headers, rows, right=(1, 2, 3, 4, 5), caption=caption)


def uneven_section(report: InspectReport) -> Section:
    u = report.memory.fsdp_uneven
    assert u is not None
    fullest = (
        f"rank {u.fullest_rank} holds {human_bytes(u.fullest_bytes)}: {u.excess_percent:.1f}% "
        f"({human_bytes(u.excess_bytes)}) more than an even split ({human_bytes(u.even_bytes)})"
    )
    rows = [("parameters", ", ".join(u.params)), ("why", WHY), ("fullest rank", fullest)]
    if u.shard_placement_fn:
        rows.append(
            (
                "with Shard(1)",
                f"{human_bytes(u.dim1_bytes)} on the fullest rank, Shard(1) for "
                + ", ".join(u.dim1_params),
            )
        )
        rows.append(
            (
                "remedy",
                f"{u.shard_placement_fn}  (from torch.distributed.tensor import Shard; pass it "
                "to every fully_shard call; --fsdp-placement auto models it)",
            )
        )
    if u.stuck_params:
        rows.append(("no even dim 1", f"{', '.join(u.stuck_params)}: these stay on Shard(0)"))
    flat = _scheme(report, FLAT)
    rows.append(
        (
            "flat layout",
            f"{human_bytes(flat.persistent)} persistent per rank (yafsdp column): "
            "a flat buffer splits evenly whatever the shapes",
        )
    )
    title = f"warning: FSDP2 splits parameters unevenly at world size {report.inputs.world_size}"
    return Section(title, ("", ""), tuple(rows))


def warning_line(report: InspectReport) -> str:
    """The warning as one line (for stderr under --json); "" when there is none."""
    u = report.memory.fsdp_uneven
    if u is None:
        return ""
    fix = ""
    if u.shard_placement_fn:
        fix = f"; {u.shard_placement_fn} gives {human_bytes(u.dim1_bytes)}"
    return (
        f"warning: FSDP2's fullest rank holds {u.excess_percent:.1f}% more than an even split "
        f"({human_bytes(u.fullest_bytes)} vs {human_bytes(u.even_bytes)}) at world size "
        f"{report.inputs.world_size}: {', '.join(u.params)} split unevenly on dim 0{fix}"
    )


def _ranks(ranks: Sequence[int]) -> str:
    first, last = ranks
    return str(first) if first == last else f"{first}-{last}"
