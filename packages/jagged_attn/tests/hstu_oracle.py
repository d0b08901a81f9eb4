"""Test-only oracle: generative-recommenders' pure-PyTorch HSTU attention, written
independently.

Semantics (not code) from ``generative_recommenders/ops/pytorch/pt_hstu_attention.py``
(``pytorch_hstu_mha``, ``pytorch_cached_hstu_mha`` and their mask builder
``_get_valid_attn_mask``):

* sequences are padded to ``N = max_seq_len`` rows; ``O = (SiLU(alpha * Q K^T) / N * M) V``
  per sequence and head, with the padding's keys and values zero;
* the mask ``M`` works on *ids* rather than positions: ``id(t) = t``; with
  ``contextual_seq_len = c > 0`` ids become ``max(t - c + 1, 0)`` (the first ``c``
  positions share id 0) and the largest id ``len - c + 1``; with ``num_targets = n`` the
  largest id drops by ``n`` and ids are clamped to it (every target shares the first
  target's id);
* with ``dist = id(row) - id(col)``: ``M = (row == col) or dist > 0`` (causal; ``dist != 0``
  otherwise), ``and dist <= max_attn_len`` when ``max_attn_len > 0``, ``or (id(row) == 0 and
  id(col) < largest id)`` when ``c > 0`` (contextual rows see every non-target key);
* the cached ("delta") variant takes ``delta`` new queries per sequence, the last ``delta``
  positions of each sequence, and applies the causal mask rows of those positions to the
  full keys: queries shorter than keys, aligned at the end.

``min_full_attn_seq_len`` and ``attn_scale`` are not modelled (hyperrec has neither). Nothing
here calls hyperrec. Computation happens in ``dtype`` (float64 for the exact answer, the
input dtype for the same-dtype baseline of the accuracy rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cached_hstu_mha_ref", "hstu_mha_ref", "hstu_valid_mask"]


def hstu_valid_mask(
    n: int,
    lengths: list[int],
    *,
    num_targets: list[int] | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    causal: bool = True,
) -> torch.Tensor:
    """``(B, n, n)`` bool: may row position ``r`` attend to column position ``c``."""
    batch = len(lengths)
    pos = torch.arange(n).view(1, n).expand(batch, n)
    largest = torch.tensor(lengths).view(batch, 1)
    ids = pos
    if contextual_seq_len > 0:
        ids = (pos - contextual_seq_len + 1).clamp(min=0)
        largest = largest - contextual_seq_len + 1
    if num_targets is not None:
        largest = largest - torch.tensor(num_targets).view(batch, 1)
        ids = torch.minimum(ids, largest)
    row, col = ids[:, :, None], ids[:, None, :]
    dist = row - col
    if not causal:
        dist = dist.abs()
    valid = torch.eye(n, dtype=torch.bool).expand(batch, n, n) | (dist > 0)
    if max_attn_len > 0:
        valid = valid & (dist <= max_attn_len)
    if contextual_seq_len > 0:
        valid = valid | ((row == 0) & (col < largest[:, :, None]))
    return valid


def _pad(x: torch.Tensor, offsets: list[int], n: int) -> torch.Tensor:
    out = x.new_zeros(len(offsets) - 1, n, *x.shape[1:])
    for b in range(len(offsets) - 1):
        out[b, : offsets[b + 1] - offsets[b]] = x[offsets[b] : offsets[b + 1]]
    return out


def hstu_mha_ref(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: list[int],
    *,
    num_targets: list[int] | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    causal: bool = True,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Jagged self-attention ``(T, H, D)`` -> ``(T, H, Dv)`` in ``dtype``."""
    n = max_seq_len
    lengths = [b - a for a, b in zip(seq_offsets, seq_offsets[1:])]
    qp, kp, vp = (_pad(t.to(dtype), seq_offsets, n) for t in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", qp, kp) * alpha
    mask = hstu_valid_mask(
        n,
        lengths,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        causal=causal,
    )
    w = F.silu(s) / n * mask[:, None]
    out = torch.einsum("bhij,bjhd->bihd", w, vp)
    rows = [out[b, :length] for b, length in enumerate(lengths)]
    return torch.cat(rows) if rows else out.new_zeros(0, *out.shape[2:])


def cached_hstu_mha_ref(
    max_seq_len: int,
    alpha: float,
    delta_q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: list[int],
    *,
    num_targets: list[int] | None = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``delta_q (B * delta, H, D)``: the last ``delta`` positions of each of the ``B``
    sequences of ``k``/``v`` (every sequence at least ``delta`` long) -> ``(B * delta, H,
    Dv)`` in ``dtype``."""
    n = max_seq_len
    batch = len(seq_offsets) - 1
    lengths = [b - a for a, b in zip(seq_offsets, seq_offsets[1:])]
    delta = delta_q.shape[0] // batch
    kp, vp = (_pad(t.to(dtype), seq_offsets, n) for t in (k, v))
    dq = delta_q.to(dtype).view(batch, delta, *delta_q.shape[1:])
    s = torch.einsum("bihd,bjhd->bhij", dq, kp) * alpha
    full = hstu_valid_mask(
        n,
        lengths,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
    )
    rows = torch.stack([full[b, lengths[b] - delta : lengths[b]] for b in range(batch)])
    w = F.silu(s) / n * rows[:, None]
    out = torch.einsum("bhij,bjhd->bihd", w, vp)
    return out.reshape(batch * delta, *out.shape[2:])
