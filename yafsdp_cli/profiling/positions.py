"""A sequence longer than the model's position table: one line that says so.

A learned position table (GPT-2's ``wpe``, BERT's ``position_embeddings``) has
``n_positions`` rows, and a longer sequence makes the embedding kernel fail with
``IndexError: index out of range in self``; the fake step checks real indices the
same way (``fake.FakeStep``), so both runs fail alike. Models with rotary positions
have no table and run at any length; their ``max_position_embeddings`` is the
length they were trained at, not a limit, so it is not enforced.
"""

from __future__ import annotations

import contextlib

from torch import nn

from ..errors import YafsdpError

LIMIT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "block_size", "max_seq_len")
FORWARD_FAILED = "the model's forward failed"  # how engine.train_step.run_forward's errors begin


class PositionLimitError(YafsdpError):
    """The batch is longer than the model's positions (or an index is past a table)."""


def position_limit(module: nn.Module) -> tuple[str, int] | None:
    """``(config key, value)`` of the first position limit the model's config states."""
    config = getattr(module, "config", None)
    for key in LIMIT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key, value
    return None


def tokens(opts) -> int:
    """The sequence length the batch has."""
    return opts.step.input_shape[-1] if opts.step.input_shape else opts.step.seq_len


@contextlib.contextmanager
def index_errors(module: nn.Module, opts):
    """A forward that failed on a batch longer than the model's stated position limit
    (an embedding index past its table, a position buffer too short to expand), or on
    an index past a table, as one clear error."""
    try:
        yield
    except YafsdpError as exc:
        cause = exc.__cause__
        if isinstance(exc, PositionLimitError) or cause is None:
            raise
        message = _message(module, opts, cause, str(exc).startswith(FORWARD_FAILED))
        if message is None:
            raise
        raise PositionLimitError(message) from cause


def _message(module: nn.Module, opts, exc: BaseException, in_forward: bool) -> str | None:
    n, name = tokens(opts), type(module).__name__
    limit = position_limit(module)
    if in_forward and limit is not None and n > limit[1]:
        key, value = limit
        return (
            f"--seq-len {n} is longer than {name} takes: {value} positions (config {key}); "
            f"use --seq-len {value} or less"
        )
    if not isinstance(exc, IndexError):
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "IndexError"
    return (
        f"the model's forward failed: an embedding index is past its table ({first}); "
        f"is --seq-len {n} longer than the model's positions, or --input-shape wrong?"
    )
