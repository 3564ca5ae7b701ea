"""``check --baseline PLAN.json``: plan again with the options a saved plan recorded.

A saved ``yafsdp plan --json`` document records its options flat (``PlanOptions``'
``flat()``); they rebuild the same layout, step and memory pieces, plan runs again,
and a configuration that fitted and no longer fits is a regression
(``regressions.plan_regressions``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import YafsdpError
from ..planning import PlanOptions, plan_source
from .regressions import plan_regressions


@dataclass(frozen=True, slots=True)
class PlanRecheck:
    lost: tuple[str, ...]  # each configuration that fitted and no longer does
    checked: int  # configurations planned again

    @property
    def passed(self) -> bool:
        return not self.lost


def recheck_plan(
    doc: Mapping[str, Any], trust_pickle: bool, where: str = "the saved plan"
) -> PlanRecheck:
    """Plan ``doc``'s source again with its recorded options (see the module docstring);
    options the options model refuses (a NaN, an unknown name) are an error naming
    ``where`` (the file) before anything runs."""
    recorded = {k: tuple(v) if isinstance(v, list) else v for k, v in doc["options"].items()}
    # a plan saved before the step took other losses than the projection was measured with it
    recorded.setdefault("loss", "projection")
    try:
        opts = PlanOptions.from_recorded(recorded)
    except (YafsdpError, TypeError) as exc:
        raise YafsdpError(f"{where}: recorded options: {exc}") from None
    report = plan_source(
        doc.get("source_path"), model=doc.get("model"), trust_pickle=trust_pickle, opts=opts
    )
    return PlanRecheck(plan_regressions(doc, report), len(report.rows))
