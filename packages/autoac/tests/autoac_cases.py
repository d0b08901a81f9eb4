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


def measure_under(model: nn.Module, step, plan_):
    """``autoac.measure_step`` (gradients kept) with ``plan_`` in force, then removed."""
    from hyperrec import autoac

    h = autoac.apply_plan(model, plan_)
    try:
        return autoac.measure_step(model, step, keep_grads=True)
    finally:
        h.remove()


def step_for(x: torch.Tensor):
    def step(m: nn.Module) -> torch.Tensor:
        return m(x).float().square().mean()

    return step


def policy_before_op_contexts(policy, allow_cache_entry_mutation=False):
    """``create_selective_checkpoint_contexts`` as torch <= 2.11 runs it: the policy is
    asked about an op *before* the op runs (later versions ask after, passing the
    output). Works on any torch: the decision is taken first, then torch's own caching
    mode runs the op and is handed that decision."""
    import torch.utils.checkpoint as ckpt

    class _PolicyFirst(ckpt._CachingTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ignored = getattr(ckpt, "SAC_IGNORED_OPS", ())
            if func in ignored:
                return super().__torch_dispatch__(func, types, args, kwargs)
            policy_fn = self.policy_fn
            decided = policy_fn(
                ckpt.SelectiveCheckpointContext(is_recompute=False), func, *args, **kwargs
            )
            self.policy_fn = lambda *a, **k: decided
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.policy_fn = policy_fn

    caching, cached = ckpt.create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation)
    caching.__class__ = _PolicyFirst
    return caching, cached
