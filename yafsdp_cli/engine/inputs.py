"""Seeded inputs and a loss for a model whose forward takes one tensor.

The input kind comes from the first module with parameters: an ``Embedding`` means
token ids (B, T), a convolution images (B, C, 16, ...), a ``Linear`` features
(B, in_features). ``input_shape`` overrides it. The loss projects the output on a
fixed random tensor so every output element, and so every parameter, gets a
gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..errors import YafsdpError


def first_layer(module: nn.Module) -> nn.Module | None:
    for m in module.modules():
        if isinstance(m, (nn.Embedding, nn.Linear, nn.modules.conv._ConvNd)):
            return m
    return None


class BatchChoice(Protocol):
    """The inputs of a step: ``options.StepOptions`` (the engine cannot import the
    options room, which sits above it, so it names the fields it reads)."""

    batch: int
    seq_len: int | None
    seed: int
    input_shape: Sequence[int] | None


@dataclass(frozen=True, slots=True)
class BatchDefaults:
    """``StepOptions()``'s inputs."""

    batch: int = 2
    seq_len: int | None = 16
    seed: int = 0
    input_shape: Sequence[int] | None = None


def make_input(
    module: nn.Module, step: BatchChoice | None = None, *, seed: int | None = None
) -> torch.Tensor:
    """One seeded input tensor for ``module`` as ``step`` says (None: the defaults);
    ``seed`` in place of the step's."""
    step = BatchDefaults() if step is None else step
    batch, seq_len, input_shape = step.batch, step.seq_len, step.input_shape
    g = torch.Generator().manual_seed(step.seed if seed is None else seed)
    layer = first_layer(module)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if isinstance(layer, nn.Embedding):
        shape = tuple(input_shape) if input_shape else (batch, seq_len)
        return torch.randint(0, layer.num_embeddings, shape, generator=g).to(device)
    if layer is None and not input_shape:
        raise YafsdpError("cannot tell what this model takes as input; give --input-shape")
    dtype = layer.weight.dtype if layer is not None else torch.float32
    if input_shape:
        shape = tuple(input_shape)
    elif isinstance(layer, nn.Linear):
        shape = (batch, layer.in_features)
    else:
        spatial = len(layer.kernel_size)
        shape = (batch, layer.in_channels, *([16] * spatial))
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def projection_loss(output: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``(output * R).sum()`` in float32 for a seeded random ``R`` of output's shape."""
    g = torch.Generator().manual_seed(seed + 1)
    r = torch.randn(output.shape, generator=g).to(output.device)
    return (output.float() * r).sum()
