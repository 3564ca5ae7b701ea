"""A plain stack of layers for the periodic-trace tests, with one layer that may run
other ops than the rest (``odd``) while its parameters and settings match theirs:
the case the period's check must catch. Factories by name, for ``--model``."""

from __future__ import annotations

import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, index: int, odd: int):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.layer_idx = index  # a place, not a setting: the stack's signature ignores it
        self.odd = odd

    def forward(self, x):
        y = self.lin(x)
        if self.layer_idx == self.odd:  # one layer saves more for backward, runs more ops
            y = y * torch.sigmoid(y)
        return torch.relu(y) + x


class Stack(nn.Module):
    def __init__(self, odd: int, depth: int = 12):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(Layer(i, odd) for i in range(depth))
        self.head = nn.Linear(16, 32)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def regular():
    return Stack(odd=-1)


def odd_at_3():
    return Stack(odd=3)


def deep_odd_at_3():
    return Stack(odd=3, depth=16)


def deep_odd_at_4():
    return Stack(odd=4, depth=16)


def deep_odd_at_11():
    return Stack(odd=11, depth=16)


def wide_llama():
    """The sample Llama with a vocabulary whose embedding and head each outweigh a
    block (1024 x 64 beside a block's 36,864 elements): both are units of their own."""
    from sample_models.models import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1024, dtype="float32"))
