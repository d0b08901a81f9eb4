"""Test-only oracle: flash-attn's padded reference attention, written independently.

Semantics (not code) from the flash-attention repository: ``attention_ref`` and
``construct_local_mask`` in its ``tests/test_flash_attn.py`` (and ``hopper/test_util.py``),
and the ``flash_attn_varlen_func`` docstring:

* inputs padded to ``(B, S, H, D)`` with boolean padding masks of the valid query/key rows;
  scores ``scale * q . k`` (``scale`` defaults to ``1 / sqrt(D)``), padded keys get -inf;
* ``window_size = (left, right)``, -1 meaning unbounded on that side; ``causal`` is the
  window ``(left, 0)``;
* alignment is bottom-right (flash-attn >= 2.1): with ``sq`` valid queries and ``sk`` valid
  keys, query row ``r`` may see key column ``c`` iff
  ``r + sk - sq - left <= c <= r + sk - sq + right`` (each bound only where finite);
* a query row that sees no key outputs 0 (``attention_ref`` zero-fills rows the local mask
  covers entirely, and a sequence without keys outputs 0); padded query rows output 0.

``upcast=False`` computes in the input dtype: the same-dtype baseline of the accuracy rule,
as flash-attn's own tests use it. Nothing here calls hyperrec.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_ref", "jagged_to_padded", "padded_to_jagged", "varlen_attention_ref"]


def jagged_to_padded(
    x: torch.Tensor, offsets: list[int], max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, H, D)`` rows of ``B`` sequences -> ``(B, max_len, H, D)`` zero-padded and the
    ``(B, max_len)`` bool mask of valid rows."""
    batch = len(offsets) - 1
    out = x.new_zeros(batch, max_len, *x.shape[1:])
    valid = torch.zeros(batch, max_len, dtype=torch.bool)
    for b in range(batch):
        n = offsets[b + 1] - offsets[b]
        out[b, :n] = x[offsets[b] : offsets[b + 1]]
        valid[b, :n] = True
    return out, valid


def padded_to_jagged(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The inverse of :func:`jagged_to_padded` (drops the padding rows)."""
    rows = [x[b, : offsets[b + 1] - offsets[b]] for b in range(len(offsets) - 1)]
    return torch.cat(rows) if rows else x.new_zeros(0, *x.shape[2:])


def _local_mask(q_valid: torch.Tensor, k_valid: torch.Tensor, left: int, right: int):
    """``(B, Sq, Sk)`` True where the window *hides* the key (flash-attn's convention)."""
    sq = q_valid.sum(-1).view(-1, 1, 1)
    sk = k_valid.sum(-1).view(-1, 1, 1)
    row = torch.arange(q_valid.shape[1]).view(1, -1, 1)
    col = torch.arange(k_valid.shape[1]).view(1, 1, -1)
    pos = row + sk - sq  # the key column the query row lines up with
    hidden = torch.zeros(q_valid.shape[0], q_valid.shape[1], k_valid.shape[1], dtype=torch.bool)
    if right >= 0:
        hidden |= col > pos + right
    if left >= 0:
        hidden |= col < pos - left
    return hidden


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_valid: torch.Tensor,
    k_valid: torch.Tensor,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """Padded ``(B, Sq, H, D)`` / ``(B, Sk, H, D)`` inputs -> ``(B, Sq, H, Dv)`` output in
    ``q.dtype`` (float64 math when ``upcast`` and the input is float64, float32 when
    ``upcast`` and lower precision, the input dtype otherwise)."""
    left, right = window_size
    if causal:
        right = 0
    dtype = q.dtype
    if upcast:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q, k, v = q.to(work), k.to(work), v.to(work)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bihd,bjhd->bhij", q * scale, k)
    hidden = ~k_valid[:, None, None, :]
    if left >= 0 or right >= 0:
        hidden = hidden | _local_mask(q_valid, k_valid, left, right)[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    nothing = hidden.all(-1, keepdim=True)  # no visible key: output 0, not NaN
    weights = weights.masked_fill(nothing | ~q_valid[:, None, :, None], 0.0)
    out = torch.einsum("bhij,bjhd->bihd", weights, v)
    return out.to(dtype)


def varlen_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: list[int],
    kv_offsets: list[int],
    **kwargs,
) -> torch.Tensor:
    """:func:`attention_ref` on jagged ``(T, H, D)`` inputs (padded in and out), as
    ``flash_attn_varlen_func`` would be checked: ``(Tq, H, Dv)``."""
    max_q = max((b - a for a, b in zip(q_offsets, q_offsets[1:])), default=0)
    max_k = max((b - a for a, b in zip(kv_offsets, kv_offsets[1:])), default=0)
    qp, q_valid = jagged_to_padded(q, q_offsets, max_q)
    kp, k_valid = jagged_to_padded(k, kv_offsets, max_k)
    vp, _ = jagged_to_padded(v, kv_offsets, max_k)
    return padded_to_jagged(attention_ref(qp, kp, vp, q_valid, k_valid, **kwargs), q_offsets)
