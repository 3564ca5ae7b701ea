"""``yafsdp verify``: does the converted model train exactly like the original?

Owns the options and results of the check and the set-up both runs share
(``harness``), the tensor comparison (``compare``), the peak estimate and the run it
allows (``budget``, ``blocks``, ``run_plan``), the single-process run (``single``,
with ``store`` and ``offload`` keeping tensors on disk), the distributed run on N
ranks (``dist``) and the entry points that pick one (``entry``). It may import
``memory``, ``sources``, ``engine``, ``errors``; ``planning`` (the memory this
process may use), ``report`` and ``cli`` (the checkpoint commands too) import it.
"""

from .entry import check_before_launch, model_check, verify_model, verify_source
from .harness import TensorDiff, VerifyOptions, VerifyReport
from .run_plan import MemoryBudgetError, RunPlan, plan_run

__all__ = [
    "MemoryBudgetError",
    "RunPlan",
    "plan_run",
    "TensorDiff",
    "VerifyOptions",
    "VerifyReport",
    "check_before_launch",
    "model_check",
    "verify_model",
    "verify_source",
]
