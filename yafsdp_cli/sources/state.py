"""What a training checkpoint holds besides the weights: plain results, no torch.

``sources.dcp_folder`` fills them from a DCP folder's metadata; ``inspect`` reports them
without importing torch (a safetensors source never does).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StateGroup:
    """Tensors of one kind in a training checkpoint: an optimizer state (``exp_avg``)
    over every parameter, or one other top-level entry (``lr_scheduler``)."""

    name: str
    tensors: int
    numel: int
    bytes: int
    dtypes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """What a training checkpoint holds besides the weights, from its metadata alone."""

    format: str  # "dcp"
    model_key: str | None  # the entry the weights are under ("model"); None: top level
    files: int  # data files (dcp.save writes one per saving rank by default)
    model_tensors: int
    model_bytes: int
    optimizer_kind: str | None  # "adamw" (exp_avg + exp_avg_sq), "sgd" (momentum_buffer)
    optimizer_params: int  # parameters that have optimizer state
    without_state: tuple[str, ...]  # floating weights with none (tied, frozen, buffers)
    optimizer: tuple[StateGroup, ...]  # one per state name, step counters included
    optimizer_bytes: int  # every optimizer tensor
    other: tuple[StateGroup, ...]  # other top-level entries' tensors
    non_tensor_items: int  # pickled values (param groups, counters): not read

    @property
    def state_bytes(self) -> int:
        """Optimizer state proper: every group but the 0-d ``step`` counters."""
        return sum(g.bytes for g in self.optimizer if g.name != "step")


class IntKey(int):
    """A key path step that is an integer dict key (``optimizer.state_dict()``'s
    parameter numbers), where a plain ``int`` step is a list index."""
