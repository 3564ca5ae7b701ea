"""The options model: what every command is asked, defined and validated once.

Three pieces, each a frozen dataclass that checks its own ranges, choices and
dtypes in ``__post_init__``:

- ``LayoutOptions``: which parameters become flat buffers and how they are laid out
  (filters, excludes, units, world size, alignment);
- ``StepOptions``: the training step (optimizer and its implementation, batch,
  sequence length, micro-batches accumulated per optimizer step (``grad_accum``),
  input shape, seed, device, kernels' target, activation
  checkpointing, parameter and gradient dtypes, and what trains: ``--freeze``,
  ``--lora``, ``--quantize``);
- ``MemoryOptions``: the memory configuration (GPU memory, the memory
  beside the allocator and the margin, allocator rounding and settings, master
  weights, FSDP2 placement): where a new memory-model input goes. Its
  ``rounding(kernels)`` is the one rounding rule of every command: ``--round-bytes``,
  else 512 B for CUDA's kernels and 1 B for the CPU's.

Sizes on the command line (``80GiB``; a bare number is an error, ``80GB`` is SI and
echoed in GiB) are parsed in ``sizes``, with the reserve's check that names the
option the user typed.

The dtype a model is trained in follows one rule (``training_dtype``): --param-dtype,
else as stored, else (a source that stores none) ``DEFAULT_TRAINING_DTYPE``.

A command's options (``ProfileOptions``, ``VerifyOptions``, ``PlanOptions``,
``InspectOptions``) hold these pieces whole (``opts.layout``, ``opts.step``,
``opts.memory``) beside the command's own fields; the library passes a piece on as
one object and derives another with ``dataclasses.replace``. It imports the
engine's torch-free choices only; every command room imports it.
"""

from __future__ import annotations

from .pieces import (
    CUDA_ROUND_BYTES,
    DEFAULT_MARGIN,
    OUTSIDE_PARTS,
    LayoutOptions,
    MemoryOptions,
    StepOptions,
    check_at_least,
    check_training_dtypes,
)
from .sizes import check_reserve, parse_size, si_echo
from .training_dtype import DEFAULT_TRAINING_DTYPE, TrainingDtype, training_dtype

__all__ = [
    "CUDA_ROUND_BYTES",
    "DEFAULT_MARGIN",
    "OUTSIDE_PARTS",
    "DEFAULT_TRAINING_DTYPE",
    "LayoutOptions",
    "MemoryOptions",
    "StepOptions",
    "TrainingDtype",
    "check_at_least",
    "check_reserve",
    "check_training_dtypes",
    "parse_size",
    "si_echo",
    "training_dtype",
]
