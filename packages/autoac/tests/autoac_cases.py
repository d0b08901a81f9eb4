"""Small models for the autoac tests (CPU, a few MB of activations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, dim: int, p: float = 0.0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        if self.p:
            h = F.dropout(h, self.p, self.training)
        return x + self.fc2(h)


class AttnBlock(nn.Module):
    """Pre-norm transformer block: causal SDPA, SiLU MLP, dropout on the residual."""

    def __init__(self, dim: int, heads: int, p: float = 0.0) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = self.o(a.transpose(1, 2).reshape(b, t, d))
        x = x + (F.dropout(a, self.p, self.training) if self.p else a)
        return x + self.fc2(F.silu(self.fc1(self.ln2(x))))


class Tower(nn.Module):
    def __init__(self, blocks: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp_tower(n: int = 3, dim: int = 32, p: float = 0.0, seed: int = 0) -> Tower:
    torch.manual_seed(seed)
    return Tower([MLPBlock(dim, p) for _ in range(n)], dim)


def attn_tower(n: int = 3, dim: int = 32, heads: int = 4, p: float = 0.0, seed: int = 0) -> Tower:
    torch.manual_seed(seed)
    return Tower([AttnBlock(dim, heads, p) for _ in range(n)], dim)


def step_for(x: torch.Tensor):
    def step(m: nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    return step
