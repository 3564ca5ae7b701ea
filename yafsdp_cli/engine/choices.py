"""The named choices of a training step and of the memory model, and their checks.

Torch-free, so that the options model (``yafsdp_cli.options``) validates a choice
without importing torch; the runtime that acts on a choice (``train_step``,
``idioms``, ``memory.fsdp2``) reads its list from here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import YafsdpError

OPTIMIZERS = ("adamw", "adam", "sgd", "none")
OPTIMIZER_IMPLS = ("auto", "for-loop", "foreach", "fused")
CHECKPOINTING = ("none", "reentrant", "non-reentrant", "selective:op", "selective:layer=N")
DEVICES = ("cpu", "cuda")
PLACEMENTS = ("dim0", "auto")  # FSDP2: fully_shard's dim-0 split, or Shard(1) where better


def check_optimizer(kind: str, impl: str = "for-loop") -> None:
    if kind not in OPTIMIZERS:
        raise YafsdpError(f"--optimizer {kind!r} is not one of {'|'.join(OPTIMIZERS)}")
    if impl not in OPTIMIZER_IMPLS:
        raise YafsdpError(f"--optimizer-impl {impl!r} is not one of {'|'.join(OPTIMIZER_IMPLS)}")


LAYER_PREFIX = "selective:layer="


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """A ``--checkpointing`` mode, read: which blocks are checkpointed and how.

    ``every``: the blocks checkpointed are those whose 1-based position among the
    blocks is a multiple of it (torchtitan's ``selective_ac_option`` of a number:
    its count starts at 1 and checkpoints where ``count % every == 0``, so
    ``selective:layer=2`` checkpoints the second, fourth, ... block; 1: every block).
    ``selective_op``: each checkpointed block saves the outputs of the ops on
    ``engine.selective.SAVE_LIST`` and recomputes the rest."""

    mode: str  # as given: what rows and reports carry
    enabled: bool
    reentrant: bool = False
    every: int = 1
    selective_op: bool = False


def parse_checkpointing(mode: str) -> Checkpointing:
    """``mode`` read (see ``Checkpointing``); a clear error where it is none of them."""
    if mode == "none":
        return Checkpointing(mode, enabled=False)
    if mode in ("reentrant", "non-reentrant"):
        return Checkpointing(mode, enabled=True, reentrant=mode == "reentrant")
    if mode == "selective:op":
        return Checkpointing(mode, enabled=True, selective_op=True)
    if mode.startswith(LAYER_PREFIX):
        n = mode[len(LAYER_PREFIX) :]
        if not (n.isascii() and n.isdigit() and not n.startswith("0")):
            raise YafsdpError(
                f"--checkpointing {mode!r}: N in selective:layer=N is a whole number from 1 "
                "up, in digits without a leading 0 (selective:layer=2: every 2nd block)"
            )
        return Checkpointing(mode, enabled=True, every=int(n))
    raise YafsdpError(f"--checkpointing {mode!r} is not one of {'|'.join(CHECKPOINTING)}")


def check_checkpointing(mode: str) -> None:
    parse_checkpointing(mode)


def describe_checkpointing(mode: str) -> str:
    """What a selective mode checkpoints, in words (a plan's note); "" for the others."""
    ck = parse_checkpointing(mode)
    if ck.selective_op:
        return (
            f"{mode}: every unit non-reentrant under torchtitan's op policy: the outputs of "
            "aten.mm (every second one of a unit recomputed), of sdpa's fused attention "
            "kernels, of reduce_scatter_tensor and of aten.max saved, the rest recomputed "
            "(docs/plan.md)"
        )
    if ck.every > 1:
        return (
            f"{mode}: the {nth(ck.every)}, {nth(2 * ck.every)}, ... unit (counted from 1, "
            "torchtitan's rule) checkpointed whole, non-reentrant; the others not"
        )
    if ck.mode.startswith(LAYER_PREFIX):
        return f"{mode}: every unit, as non-reentrant"
    return ""


def nth(n: int) -> str:
    """``2nd``, ``3rd``, ``11th``: how a report names the every-N-th block."""
    tens = n % 100
    suffix = "th" if 10 <= tens <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def layer_period(mode: str) -> int:
    """How many blocks the checkpointing pattern of ``mode`` takes to repeat: N for
    ``selective:layer=N``, else 1."""
    return parse_checkpointing(mode).every


def check_device(flag: str, device: str) -> None:
    if device not in DEVICES:
        raise YafsdpError(f"{flag} {device!r} is not cpu or cuda")


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise YafsdpError(f"--fsdp-placement {placement!r} is not one of {'|'.join(PLACEMENTS)}")
    return placement


LOSSES = ("model", "ce", "fused-ce", "chunked-ce", "projection")
DEFAULT_CHUNKS = 8
MAX_CHUNKS = 4096


@dataclass(frozen=True, slots=True)
class Loss:
    """A parsed ``--loss``: its kind, and for ``chunked-ce`` its number of chunks."""

    kind: str
    chunks: int = 0

    @property
    def name(self) -> str:
        """As ``--loss`` writes it."""
        return f"{self.kind}:{self.chunks}" if self.kind == "chunked-ce" else self.kind

    def describe(self, tokens: int | None = None, vocab: int | None = None) -> str:
        """The loss in words, for a step of ``tokens`` tokens and ``vocab`` logits each
        where known: what a chunk holds."""
        if self.kind == "model":
            return "the model's own loss (labels=)"
        if self.kind == "ce":
            return "cross-entropy on the whole logits, float32"
        if self.kind == "projection":
            return "projection (output x R).sum(), float32"
        if self.kind == "fused-ce":
            return "fused cross-entropy: the whole logits held, their gradient made in the backward"
        per = ""
        if tokens:
            size = -(-tokens // self.chunks)
            per = f" of {size:,} tokens" + (f" x {vocab:,} logits" if vocab else "")
        return f"chunked cross-entropy, {self.chunks} chunks{per} made and freed in turn"


def parse_loss(text: str | None) -> Loss | None:
    """``--loss``'s value (None: the model's default, ``resolve_loss``)."""
    if text is None:
        return None
    kind, _, count = text.strip().partition(":")
    if kind not in LOSSES:
        raise YafsdpError(f"--loss {text!r} is not one of {' | '.join(LOSSES)} (chunked-ce:N)")
    if kind != "chunked-ce":
        if count:
            raise YafsdpError(f"--loss {text!r}: only chunked-ce takes a count (chunked-ce:N)")
        return Loss(kind)
    if not count:
        return Loss(kind, DEFAULT_CHUNKS)
    if not count.isdigit() or not 1 <= int(count) <= MAX_CHUNKS:
        raise YafsdpError(
            f"--loss {text!r}: the number of chunks must be a whole number from 1 to {MAX_CHUNKS}"
        )
    return Loss(kind, int(count))
