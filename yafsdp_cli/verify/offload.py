"""The optimizer of a single-process verify, its state on disk between parameters.

Why: a model's optimizer state (AdamW: two tensors the size of the parameters) is
needed only inside ``step()``, one parameter at a time, yet an ordinary optimizer
holds all of it through every forward and backward, the half of the training state
that verify has no use for there. So ``OffloadedOptimizer`` keeps one optimizer per
parameter (for-loop kernels: every parameter is stepped on its own anyway, so the
updates are the very same as one optimizer over all of them), and around each
parameter's step reads its state back from a file in the run's private folder,
steps, and writes the state back out before the next parameter's is read. Held at
once: the parameters, the gradients, and one parameter's state and temporaries.
GPT-2 124M (``python -m benchmarks.bench_verify gpt2``): the peak drops from 1.54x
one model's training state to about 1.1x.

The files are written and read with plain ``write``/``read`` (no memory map that
would count in RSS); the page cache keeps them until the kernel needs the memory,
when it writes them to disk. After the last step nothing is written: the run's
state is counted (``held_bytes``) but never needed again.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..engine.layout import round_up
from ..engine.train_step import make_optimizer
from .store import StepReader, keep_on_disk


class OffloadedOptimizer:
    """``make_optimizer(kind, [p])`` for every trainable ``p`` of ``params``; the state
    of each in ``folder/<tag>-<i>.safetensors`` between its steps."""

    def __init__(self, kind: str, params: Iterable[torch.Tensor], folder: Path, tag: str):
        slots = [(p, make_optimizer(kind, [p])) for p in params if p.requires_grad]
        self._slots = [(p, opt) for p, opt in slots if opt is not None]
        self._files = [folder / f"{tag}-{i}.safetensors" for i in range(len(self._slots))]
        self._kept: list[dict] = [{} for _ in self._slots]  # state that is not a tensor
        self._devices: list[dict] = [{} for _ in self._slots]  # name -> device of each tensor
        self._held: list[int] = []  # bytes of each state tensor after the last step

    def step(self, *, last: bool = False) -> None:
        """Every parameter's step in turn; with ``last`` the state is dropped, not kept."""
        self._held = []
        for i, (p, opt) in enumerate(self._slots):
            self._load(i, p, opt)
            opt.step()
            state = opt.state.pop(p, {})
            self._held += [t.untyped_storage().nbytes() for t in _tensors(state)]
            if state and not last:
                self._save(i, state)

    def held_bytes(self, round_bytes: int) -> int:
        """What the state would hold in memory after the last step, each tensor
        rounded to ``round_bytes`` (as ``harness.held_bytes`` counts storages)."""
        return sum(round_up(n, round_bytes) for n in self._held if n)

    def _load(self, i: int, p: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        path = self._files[i]
        if not path.exists():
            return  # its first step: the optimizer makes its state
        devices = self._devices[i]
        with StepReader(path) as reader:
            tensors = {n: reader.get_tensor(n).to(devices[n]) for n in reader.names()}
        opt.state[p] = {**self._kept[i], **tensors}
        path.unlink()

    def _save(self, i: int, state: dict) -> None:
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self._kept[i] = {k: v for k, v in state.items() if k not in tensors}
        self._devices[i] = {k: v.device for k, v in tensors.items()}
        keep_on_disk(self._files[i], tensors)


def _tensors(state: dict) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor)]
