"""A model whose micro-batches after the second are not the second repeated: from
the third micro-batch of a step on it runs one more op (the case the fake step's
micro-batch check must catch). It counts micro-batches by its gradients: none yet
means the first micro-batch of a step. A factory for ``--model``."""

from __future__ import annotations

import torch
from torch import nn


class Drift(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)
        self.micro_batch = 0

    def forward(self, input_ids):
        first = self.lin.weight.grad is None
        self.micro_batch = 1 if first else self.micro_batch + 1
        y = self.lin(self.embed(input_ids))
        if self.micro_batch >= 3:  # saves more for backward, runs more ops
            y = y * torch.sigmoid(y)
        return self.head(torch.relu(y))


def drift():
    return Drift()
