"""An independent oracle for the tests: the documented semantics as a plain per-sequence
loop with a per-element Python mask, computed in float64 (or a chosen dtype), and random
input builders.

Nothing here calls the package's reference or mask code; only ``gelu_poly`` (whose own
error against the exact GELU is tested in ``test_activations.py``) is shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hyperrec.jagged_attn.activations import gelu_poly


@dataclass(frozen=True)
class Mask:
    causal: bool = False
    left: int = -1
    right: int = -1
    contextual: int = 0
    block: int = 0
    previous: bool = False


def oracle_mask(lq: int, lk: int, mask: Mask, num_targets: int = 0) -> torch.Tensor:
    """``(lq, lk)`` bool: the rules of the README, one pair at a time."""
    out = torch.zeros(lq, lk, dtype=torch.bool)
    first_target = lk - num_targets
    for i in range(lq):
        p = i + lk - lq  # bottom-right alignment
        e = min(p, first_target)  # targets act as if at the first target slot
        for j in range(lk):
            if j >= first_target:
                out[i, j] = j == p
                continue
            ok = True
            if mask.causal and j > e:
                ok = False
            if mask.left >= 0 and j < e - mask.left:
                ok = False
            if mask.right >= 0 and j > e + mask.right:
                ok = False
            if mask.block:
                qb, kb = math.floor(e / mask.block), j // mask.block
                if not (kb == qb or (mask.previous and kb == qb - 1)):
                    ok = False
            if j < mask.contextual or 0 <= p < mask.contextual:
                ok = True
            out[i, j] = ok
    return out


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "gelu_poly": gelu_poly,
        "relu": F.relu,
        "sigmoid": torch.sigmoid,
        "identity": lambda t: t,
    }[name](x)


@dataclass(frozen=True)
class Call:
    """Everything but the tensors, in the public functions' terms."""

    activation: str = "softmax"
    scale: float | None = None
    output_scale: float = 1.0
    normalization: str = "none"
    max_seqlen_kv: int = 0
    mask: Mask = field(default_factory=Mask)


def oracle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: list[int],
    kv_offsets: list[int],
    call: Call,
    *,
    kv_index: list[int] | None = None,
    num_targets: list[int] | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``(Tq, H, Dv)`` in ``dtype``, differentiable by autograd."""
    scale = call.scale if call.scale is not None else 1.0 / math.sqrt(q.shape[2])
    pieces = []
    for b in range(len(q_offsets) - 1):
        m = b if kv_index is None else kv_index[b]
        qs = q[q_offsets[b] : q_offsets[b + 1]].to(dtype)
        ks = k[kv_offsets[m] : kv_offsets[m + 1]].to(dtype)
        vs = v[kv_offsets[m] : kv_offsets[m + 1]].to(dtype)
        lq, lk = qs.shape[0], ks.shape[0]
        allowed = oracle_mask(lq, lk, call.mask, 0 if num_targets is None else num_targets[b])
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if call.activation == "softmax":
            has_key = allowed.any(dim=1, keepdim=True)
            safe = torch.where(has_key, s.masked_fill(~allowed, float("-inf")), 0.0)
            w = torch.softmax(safe, dim=-1) * has_key
        else:
            # Activations run in float32 at least, as in a kernel (whose scores are fp32
            # accumulators); gelu_poly's smallest coefficients underflow float16.
            w = _act(call.activation, s.to(torch.promote_types(dtype, torch.float32)))
            w = w.to(dtype) * allowed
        if call.normalization == "max_seqlen":
            w = w / call.max_seqlen_kv
        elif call.normalization == "length" and lk > 0:
            w = w / lk
        pieces.append(torch.einsum("hij,jhd->ihd", w, vs) * call.output_scale)
    if not pieces:  # still connected to the inputs, so autograd.grad works
        return (q.sum() + k.sum() + v.sum()).to(dtype) * torch.zeros(
            0, q.shape[1], v.shape[2], dtype=dtype
        )
    return torch.cat(pieces)


def offsets_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def rand(*shape: int, dtype: torch.dtype = torch.float64, gen: torch.Generator | None = None):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@dataclass
class Problem:
    """Random jagged inputs with their offsets as lists (for the oracle) and tensors."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_offsets: list[int]
    kv_offsets: list[int]

    @property
    def q_offsets_t(self) -> torch.Tensor:
        return torch.tensor(self.q_offsets, dtype=torch.int64)

    @property
    def kv_offsets_t(self) -> torch.Tensor:
        return torch.tensor(self.kv_offsets, dtype=torch.int32)

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.q_offsets, self.q_offsets[1:])), default=0)

    @property
    def max_kv(self) -> int:
        return max((b - a for a, b in zip(self.kv_offsets, self.kv_offsets[1:])), default=0)

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fresh leaf copies that require grad."""
        return tuple(t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v))


def make_problem(
    q_lens: list[int],
    kv_lens: list[int] | None = None,
    *,
    heads: int = 2,
    dim: int = 4,
    dim_v: int | None = None,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    kv_lens = q_lens if kv_lens is None else kv_lens
    dim_v = dim if dim_v is None else dim_v
    tq, tk = sum(q_lens), sum(kv_lens)
    return Problem(
        q=rand(tq, heads, dim, dtype=dtype, gen=gen),
        k=rand(tk, heads, dim, dtype=dtype, gen=gen),
        v=rand(tk, heads, dim_v, dtype=dtype, gen=gen),
        q_offsets=offsets_of(q_lens),
        kv_offsets=offsets_of(kv_lens),
    )


def grads(out: torch.Tensor, inputs, grad_out: torch.Tensor):
    """d<out, grad_out>/d inputs, zeros where an input is unused."""
    return torch.autograd.grad(out, inputs, grad_out, allow_unused=True, materialize_grads=True)
