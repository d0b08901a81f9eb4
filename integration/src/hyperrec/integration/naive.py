"""The naive baseline's attention: padded PyTorch, as a user without hyperrec writes it.

Every function takes the model's jagged tensors (``(T, H, D)`` rows of all sequences
concatenated), pads them to ``(B, H, L_max, D)`` with zeros around the attention only
(the linear layers stay on unpadded tokens, as in TorchRec / generative-recommenders'
PyTorch path), computes the attention on the padded block and gathers the valid rows
back. The math equals :mod:`hyperrec.jagged_attn`'s calls in the model:

- softmax attention (block attention, PMA, candidate cross attention, a softmax tower)
  goes through ``F.scaled_dot_product_attention`` with a causal flag or a boolean
  key-padding mask, so PyTorch's fused kernels run it;
- the HSTU attention (``act(scale * q k^T) v / N`` under a causal mask) has no SDPA
  kernel: it is plain ``matmul -> activation -> mask -> matmul`` on padded tensors. Its
  ``(B, H, L, L)`` scores do not fit a GPU at GEM scale (8k histories), so queries are
  processed in chunks whose scores are recomputed in backward
  (``torch.utils.checkpoint``), the way any memory-efficient attention recomputes them;
  each chunk only reads the keys up to its last query (causality). Nothing else is
  checkpointed.

All sizes come from shapes and host ints (``max_len``), so nothing here reads device
values (no host synchronisation). Padding costs what padding costs: the attention work
is ``B * L_max^2`` instead of ``sum(L^2)``; that is the baseline's point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "SCORE_CHUNK_ELEMENTS",
    "JaggedLayout",
    "block_attention",
    "candidate_attention",
    "hstu_attention",
    "padded_attention_work",
    "pma_attention",
    "softmax_self_attention",
]

SCORE_CHUNK_ELEMENTS = 1 << 28
"""Upper bound on the elements of one query chunk's ``(B, H, chunk, keys)`` score tensor
in :func:`hstu_attention` (512 MiB in bf16). Each chunk re-reads the keys and values up
to its last query, so smaller chunks cost memory traffic: at ``B = 64``, 8 heads of 128
and 8k histories this bound gives chunks of 64 queries (128 chunks a layer)."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class JaggedLayout:
    """Where each jagged row sits in the padded ``(num_seqs, max_len)`` grid."""

    num_seqs: int
    """B, the number of sequences (host int)."""
    max_len: int
    """L_max, the padded length (host int, >= every sequence's length)."""
    row: torch.Tensor
    """int64 [T]: the sequence of each jagged row."""
    pos: torch.Tensor
    """int64 [T]: the row's position inside its sequence."""
    lengths: torch.Tensor
    """int64 [B]: each sequence's length."""

    @staticmethod
    def from_offsets(offsets: torch.Tensor, max_len: int, total: int) -> JaggedLayout:
        """Layout of ``offsets`` (int64 [B + 1]) holding ``total`` rows, none longer than
        ``max_len``; no device values are read."""
        b = offsets.shape[0] - 1
        lengths = offsets.diff()
        row = torch.repeat_interleave(
            torch.arange(b, device=offsets.device), lengths, output_size=total
        )
        pos = torch.arange(total, device=offsets.device) - offsets[:-1][row]
        return JaggedLayout(b, max_len, row, pos, lengths)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Jagged ``(T, H, D)`` -> zero-padded ``(B, H, L_max, D)`` (differentiable)."""
        out = x.new_zeros((self.num_seqs, self.max_len, *x.shape[1:]))
        return out.index_put((self.row, self.pos), x).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``(B, H, L_max, D)`` -> jagged ``(T, H, D)`` (the valid rows)."""
        return x.transpose(1, 2)[self.row, self.pos]

    def key_mask(self) -> torch.Tensor:
        """bool ``(B, 1, 1, L_max)``: True at valid key positions."""
        j = torch.arange(self.max_len, device=self.lengths.device)
        return (j < self.lengths[:, None]).view(self.num_seqs, 1, 1, self.max_len)


def _sdpa_over_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of padded queries over padded keys with a key-padding mask.

    A sequence without keys would give a fully masked row (NaN in SDPA); it attends to
    its zero padding instead, whose zero values give the zero output the jagged ops
    define, and the output is zeroed explicitly as well.
    """
    has_keys = valid.any(dim=-1, keepdim=True)  # (B, 1, 1, 1)
    mask = valid | ~has_keys
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out * has_keys.to(out.dtype)


def softmax_self_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: JaggedLayout, *, scale: float
) -> torch.Tensor:
    """Causal softmax self-attention of jagged ``(T, H, D)`` tensors through padded SDPA.

    Padding sits after each sequence, so a valid query's causal window holds valid keys
    only and no mask beyond ``is_causal`` is needed; padded queries are dropped.
    """
    qp, kp, vp = layout.pad(q), layout.pad(k), layout.pad(v)
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    return layout.unpad(out)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JaggedLayout,
    *,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal softmax attention inside blocks of ``block_size`` tokens of each sequence.

    The padded sequences are cut into blocks (``(B * L_max / bs, H, bs, D)``) and each
    block runs causal SDPA; as above, padding after a sequence never enters a valid
    query's window.
    """
    b, h = layout.num_seqs, q.shape[1]
    blocks = -(-layout.max_len // block_size)
    grid = JaggedLayout(b, blocks * block_size, layout.row, layout.pos, layout.lengths)

    def split(x: torch.Tensor) -> torch.Tensor:  # (B, H, blocks*bs, D) -> (B*blocks, H, bs, D)
        d = x.shape[-1]
        x = x.view(b, h, blocks, block_size, d).transpose(1, 2)
        return x.reshape(b * blocks, h, block_size, d)

    qp, kp, vp = (split(grid.pad(t)) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
    d = out.shape[-1]
    out = out.view(b, blocks, h, block_size, d).transpose(1, 2).reshape(b, h, -1, d)
    return grid.unpad(out)


def _hstu_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    start: int,
    scale: float,
    output_scale: float,
    activation: str,
) -> torch.Tensor:
    # q: (B, H, c, D) queries start .. start + c - 1; k, v: (B, H, start + c, D).
    c, n = q.shape[2], k.shape[2]
    i = torch.arange(start, start + c, device=q.device).view(1, 1, c, 1)
    j = torch.arange(n, device=q.device).view(1, 1, 1, n)
    valid = (j <= i) & (j < lengths.view(-1, 1, 1, 1))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    weights = torch.where(valid, _ACTIVATIONS[activation](scores), 0.0)
    return torch.matmul(weights.to(v.dtype), v) * output_scale


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JaggedLayout,
    *,
    activation: str,
    scale: float,
    output_scale: float,
    recompute: bool = True,
    chunk_elements: int | None = None,
) -> torch.Tensor:
    """HSTU attention ``o_i = output_scale * sum_{j <= i} act(scale <q_i, k_j>) v_j``.

    Plain PyTorch on padded ``(B, H, L_max, D)`` tensors, in query chunks of at most
    ``chunk_elements`` score elements (default :data:`SCORE_CHUNK_ELEMENTS`); with
    ``recompute`` each chunk's scores are recomputed in backward instead of saved (see
    the module doc).
    """
    if chunk_elements is None:
        chunk_elements = SCORE_CHUNK_ELEMENTS
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    qp, kp, vp = layout.pad(q), layout.pad(k), layout.pad(v)
    b, h, n = qp.shape[0], qp.shape[1], layout.max_len
    if n == 0:
        # Every sequence is empty (a batch of empty histories): no query, no chunk, and
        # torch.cat of no chunks would raise. The output has no row: v's (empty) rows.
        return layout.unpad(vp)
    chunk = max(1, min(n, chunk_elements // max(1, b * h * n)))
    parts = []
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        args = (
            qp[:, :, start:stop],
            kp[:, :, :stop],
            vp[:, :, :stop],
            layout.lengths,
            start,
            scale,
            output_scale,
            activation,
        )
        if recompute and torch.is_grad_enabled():
            parts.append(checkpoint(_hstu_chunk, *args, use_reentrant=False))
        else:
            parts.append(_hstu_chunk(*args))
    out = torch.cat(parts, dim=2) if len(parts) != 1 else parts[0]
    return layout.unpad(out)


def pma_attention(
    queries: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JaggedLayout,
    *,
    heads: int,
    scale: float,
) -> torch.Tensor:
    """PMA: the same ``P`` learned ``queries`` ``(P, dim)`` attend to every history.

    Returns ``(B, P, dim)``; an empty history pools to zeros.
    """
    b, p, dim = layout.num_seqs, queries.shape[0], queries.shape[1]
    q = queries.view(1, p, heads, dim // heads).transpose(1, 2)
    q = q.expand(b, heads, p, dim // heads).contiguous()
    out = _sdpa_over_keys(q, layout.pad(k), layout.pad(v), layout.key_mask(), scale)
    return out.transpose(1, 2).reshape(b, p, dim)


def candidate_attention(
    q: torch.Tensor,
    candidates: JaggedLayout,
    k: torch.Tensor,
    v: torch.Tensor,
    history: JaggedLayout,
    *,
    scale: float,
) -> torch.Tensor:
    """Each request's candidates ``(C, H, D)`` attend to its history ``(T, H, D)``.

    Candidates are padded per request to ``candidates.max_len`` (the configured maximum,
    a host constant) and attend through one SDPA call with a key-padding mask.
    """
    out = _sdpa_over_keys(
        candidates.pad(q), history.pad(k), history.pad(v), history.key_mask(), scale
    )
    return candidates.unpad(out)


def padded_attention_work(
    history_lengths: np.ndarray | Sequence[int],
    *,
    heads: int,
    head_dim: int,
    full_layers: int,
    block_layers: int,
    block_size: int,
    pma_queries: int,
    max_candidates: int,
    chunk_elements: int | None = None,
) -> dict[str, float]:
    """Attention work of one naive training step on one rank (padding included).

    What the padded kernels of this module compute for a batch whose requests have
    ``history_lengths`` (padded to their maximum ``L``), counted as the tensor-core
    FLOPs of the score and value GEMMs (``4 * head_dim`` per score element and head),
    forward plus backward:

    - ``hstu``: the HSTU layers' query chunks (each chunk reads the keys up to its last
      query): the forward's two GEMMs, the score GEMM recomputed in backward (the
      checkpoint stops recomputing after the last tensor backward needs) and the
      backward's four: 14 x ``head_dim`` FLOPs per computed score element;
    - ``softmax``: padded block attention (causal SDPA inside ``block_size`` blocks over
      ``ceil(L / block_size)`` blocks per request), PMA and the candidate cross attention
      (``max_candidates`` padded queries per request over ``L`` keys): 3x forward, as
      the useful count of :mod:`hyperrec.integration.flops`;

    plus ``hstu_score_elements`` (the HSTU score elements of one layer's forward: each
    is written and read by several elementwise passes, the naive path's memory traffic)
    and ``max_len``. The padded HSTU work is what the naive baseline pays that the jagged
    path does not: ``B L^2`` instead of ``sum(L^2)``.

    Raises:
        ValueError: negative lengths.
    """
    lens = np.asarray(history_lengths, dtype=np.int64).reshape(-1)
    if (lens < 0).any():
        raise ValueError("history_lengths must be non-negative")
    b = int(lens.shape[0])
    n = int(lens.max()) if b else 0
    if chunk_elements is None:
        chunk_elements = SCORE_CHUNK_ELEMENTS
    elements = 0
    if n:
        chunk = max(1, min(n, chunk_elements // max(1, b * heads * n)))
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            elements += b * heads * (stop - start) * stop
    blocks = math.ceil(n / block_size) if n and block_size else 0
    causal_block = b * blocks * heads * block_size * (block_size + 1) // 2
    softmax = block_layers * causal_block + b * heads * n * (pma_queries + max_candidates)
    return {
        "max_len": float(n),
        "hstu_score_elements": float(elements),
        "hstu": 14.0 * head_dim * elements * full_layers,
        "softmax": 3.0 * 4.0 * head_dim * softmax,
    }
