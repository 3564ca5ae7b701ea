"""Before a mismatch is reported, the original must reproduce its own numbers.

The reference run's outputs, gradients, parameters and buffers are on disk
(``store``). On a mismatch the original is put back to its starting values and run
again under the same pinned settings; its second run is compared bit for bit with
its first. A drift there means the reference is not reproducible on this machine
(a kernel that varies run to run, a thread pool resized behind torch's back), so the
comparison with the converted model proves nothing and the report says that,
naming the tensor and the size of the drift, instead of "MISMATCH".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from .harness import Recorder, TensorDiff, VerifyReport
from .store import ReferenceStore

START = -1  # the store's "step" holding the starting values
KINDS = ("output", "gradient", "parameter", "buffer")


def starting_values(module: nn.Module) -> dict[str, Mapping]:
    return {
        "parameter": {n: p.detach() for n, p in module.named_parameters()},
        "buffer": dict(module.named_buffers()),
    }


def put_back(module: nn.Module, store: ReferenceStore) -> None:
    """The module's parameters and buffers back to their starting values, in place."""
    with store.open_step(START) as handle, torch.no_grad():
        for kind, items in (("parameter", module.named_parameters()), ("buffer", None)):
            items = dict(items) if items is not None else dict(module.named_buffers())
            stored = store.view(handle, START, kind)
            for name, t in items.items():
                t.copy_(stored[name])


def first_drift(first: ReferenceStore, second: ReferenceStore, steps: int) -> TensorDiff | None:
    """The first tensor, in run order, where two runs of the original differ at all."""
    exact = Recorder({})  # no tolerance: the same model on the same inputs
    for step in range(steps):
        with first.open_step(step) as a, second.open_step(step) as b:
            for kind in KINDS:
                exact.compare_all(kind, step, second.view(b, step, kind), first.view(a, step, kind))
    return exact.first_failure


def with_recheck(report: VerifyReport, drift: TensorDiff | None) -> VerifyReport:
    """The report after the original's re-run: unchanged where it reproduced itself."""
    if drift is None:
        return report
    return replace(report, ok=False, reproducible=False, drift=drift)
