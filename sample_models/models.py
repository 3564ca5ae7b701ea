"""Small real architectures in plain PyTorch, for the demo, the tests and ``--model``.

Each factory (``mlp``, ``cnn``, ``gpt``, ``llama``, ``moe``) builds a fresh model
with its default config; ``python -m sample_models.build`` seeds them and writes
the committed checkpoints. Names follow the usual conventions (GPT-2's
``transformer.h.N``, Llama's ``model.layers.N.self_attn.q_proj``) so the tools see
the shapes they will meet in real checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Three linear layers in an ``nn.Sequential``; input (B, 64)."""

    def __init__(self, d_in: int = 64, d_hidden: int = 128, d_out: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, d_hidden),
            nn.GELU(),
            nn.Linear(d_hidden, d_hidden),
            nn.GELU(),
            nn.Linear(d_hidden, d_out),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (B, d_out)


class CNN(nn.Module):
    """Two conv + BatchNorm blocks (running statistics are module buffers); input (B, 3, 16, 16)."""

    def __init__(self, channels: int = 3, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Linear(32 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # (B, 32, 4, 4)
        return self.classifier(x.flatten(1))  # (B, classes)


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.ModuleDict(
            {
                "c_fc": nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
                "c_proj": nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        h = F.gelu(self.mlp["c_fc"](self.ln_2(x)))
        return x + self.mlp["c_proj"](h)


class GPT(nn.Module):
    """GPT-2 style decoder, ``lm_head`` tied to the token embedding; input token ids (B, T)."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or GPTConfig()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "h": nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer)),
                "ln_f": nn.LayerNorm(cfg.n_embd),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer["wte"](idx) + self.transformer["wpe"](pos)  # (B, T, C)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))  # (B, T, vocab)


@dataclass(kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    dtype: str = "bfloat16"  # matrices; norms stay float32


class RMSNorm(nn.Module):
    """Computes in float32 and keeps a float32 weight, whatever the activations' dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq)  # persistent: it travels with checkpoints

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)  # (B, T, C)
        cos, sin = self.rotary_emb(x, idx.shape[1])
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Llama-style decoder: bf16 matrices, fp32 RMSNorm weights, a rotary buffer; token ids."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.config = cfg = cfg or LlamaConfig()
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        matrix_dtype = getattr(torch, cfg.dtype)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.to(matrix_dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))  # (B, T, vocab)


class MoEBlock(nn.Module):
    """Top-1 routed experts plus a router, as in mixture-of-experts decoders."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
            for _ in range(n_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)  # (B, T, C)
        gate = self.router(h).softmax(-1)  # (B, T, E)
        weight, choice = gate.max(-1)  # (B, T)
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = (choice == i).unsqueeze(-1)  # (B, T, 1)
            out = out + mask * weight.unsqueeze(-1) * expert(h)
        return x + out


class MoE(nn.Module):
    """A tiny mixture-of-experts decoder with tied embeddings; input token ids (B, T)."""

    def __init__(
        self, vocab: int = 128, dim: int = 32, hidden: int = 64, layers: int = 2, experts: int = 4
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, hidden, experts) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * math.sqrt(self.embed.embedding_dim)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mlp() -> MLP:
    return MLP()


def cnn() -> CNN:
    return CNN()


def gpt() -> GPT:
    return GPT()


def llama() -> LlamaForCausalLM:
    return LlamaForCausalLM()


def moe() -> MoE:
    return MoE()


FACTORIES = {"mlp": mlp, "cnn": cnn, "gpt": gpt, "llama": llama, "moe": moe}
