"""Pure-PyTorch reference: the specification every backend must match.

:func:`attention_forward` computes the formula of :mod:`hyperrec.jagged_attn.spec` under
the mask of :mod:`hyperrec.jagged_attn.masks`; :func:`attention_backward` gives the
gradients with explicit formulas (the ones a kernel implements), recomputing the scores
instead of saving them. The forward is also plain differentiable PyTorch, so autograd
through it is a second, independent route to the gradients.

How it runs. The work is cut into *tiles*: a range of query rows of one (query sequence,
kv sequence) pair and the key positions those rows may need. Normally a tile is a whole
pair. With a block mask (``block_size > 0``, equal query/key lengths, no targets) each
block of queries is a tile holding only its own block, the previous one and the
contextual prefix, so block attention costs O(L) here too; contextual queries, which see
everything, get a tile of their own. Tiles only skip keys the mask rejects anyway: the
mask is always evaluated on true positions. Tiles are grouped by the power-of-two bucket
of their (query, key) sizes, each group padded to its largest tile and computed as dense
``(G, H, Lq, Lk)`` tensors in float32 (float64 for float64 inputs), with no group's score
tensor above ``GROUP_ELEMENTS`` elements. Padding costs at most ~4x the useful work. The
planning reads the offsets on the host (one device sync per call): the reference is a
spec, not a fast path.

Inputs are assumed valid (the public functions validate them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

from hyperrec.jagged_attn.activations import activation, activation_derivative
from hyperrec.jagged_attn.masks import allowed
from hyperrec.jagged_attn.spec import AttentionSpec

__all__ = ["GROUP_ELEMENTS", "attention_backward", "attention_forward"]

#: Upper bound on the elements of one group's ``(G, H, Lq, Lk)`` score tensor.
GROUP_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class _Pairs:
    """Per query sequence ``b``: where its queries and its keys start, and the lengths."""

    q_start: torch.Tensor  # (B,) int64, on the input device
    k_start: torch.Tensor
    q_len: torch.Tensor
    k_len: torch.Tensor
    targets: torch.Tensor | None


def _pairs(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
) -> _Pairs:
    q_offsets = q_offsets.long()
    kv_offsets = kv_offsets.long()
    kv_seq = torch.arange(q_offsets.numel() - 1, device=q_offsets.device)
    if kv_index is not None:
        kv_seq = kv_index.long()
    return _Pairs(
        q_start=q_offsets[:-1],
        k_start=kv_offsets[:-1][kv_seq],
        q_len=q_offsets[1:] - q_offsets[:-1],
        k_len=(kv_offsets[1:] - kv_offsets[:-1])[kv_seq],
        targets=None if num_targets is None else num_targets.long(),
    )


# A tile: (pair, q_lo, q_n, k_head, k_lo, k_n). Its query rows are positions
# [q_lo, q_lo + q_n) of the pair; its k_n keys are positions [0, k_head) followed by
# positions k_lo, k_lo + 1, ... of the pair's key sequence.
_Tile = tuple[int, int, int, int, int, int]


def _block_tiles(b: int, length: int, spec: AttentionSpec) -> list[_Tile]:
    """Tiles of a self-attention pair under a block mask (see the module doc)."""
    bs, c = spec.mask.block_size, min(spec.mask.contextual_len, length)
    back = bs if spec.mask.block_previous else 0
    tiles = [(b, 0, c, 0, 0, length)] if c else []  # contextual queries see every key
    for start in range(0, length, bs):
        q_lo, q_hi = max(start, c), min(start + bs, length)
        if q_lo >= q_hi:
            continue
        k_lo, k_hi = max(start - back, 0), q_hi
        head = min(c, k_lo)
        tiles.append((b, q_lo, q_hi - q_lo, head, k_lo, head + k_hi - k_lo))
    return tiles


def _tiles(pairs: _Pairs, spec: AttentionSpec) -> list[_Tile]:
    q_len, k_len = pairs.q_len.tolist(), pairs.k_len.tolist()
    targets = [0] * len(q_len) if pairs.targets is None else pairs.targets.tolist()
    tiles: list[_Tile] = []
    for b, (lq, lk, n) in enumerate(zip(q_len, k_len, targets)):
        if lq == 0 or lk == 0:  # the outputs are zero and nothing flows back
            continue
        if spec.mask.block_size > 0 and lq == lk and n == 0:
            tiles += _block_tiles(b, lq, spec)
        else:
            tiles.append((b, 0, lq, 0, 0, lk))
    return tiles


def _groups(pairs: _Pairs, spec: AttentionSpec, heads: int) -> list[tuple[torch.Tensor, int, int]]:
    """Tiles bucketed and chunked into groups: ``(G, 6)`` int64 tile tables, with the
    padded query and key lengths."""
    buckets: dict[tuple[int, int], list[_Tile]] = {}
    for tile in _tiles(pairs, spec):
        buckets.setdefault((tile[2].bit_length(), tile[5].bit_length()), []).append(tile)
    groups = []
    for key in sorted(buckets):
        members = buckets[key]
        lq_pad = max(t[2] for t in members)
        lk_pad = max(t[5] for t in members)
        per_group = max(1, GROUP_ELEMENTS // (heads * lq_pad * lk_pad))
        for i in range(0, len(members), per_group):
            table = torch.tensor(members[i : i + per_group], device=pairs.q_len.device)
            groups.append((table, lq_pad, lk_pad))
    return groups


def _gather(
    x: torch.Tensor, token: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Jagged ``(T, H, D)`` rows at ``token`` ``(G, P)`` -> padded ``(G, H, P, D)``."""
    # where(), not a multiply: a NaN in another sequence's row must not leak through a
    # clamped padding index (NaN * 0 is NaN).
    rows = x[token.clamp(max=max(x.shape[0] - 1, 0))].to(dtype)
    return torch.where(valid[:, :, None, None], rows, 0.0).transpose(1, 2)


@dataclass(frozen=True)
class _Group:
    """One padded group, recomputed identically by the forward and the backward."""

    q: torch.Tensor  # (G, H, Lq, D)
    k: torch.Tensor  # (G, H, Lk, D)
    v: torch.Tensor  # (G, H, Lk, Dv)
    q_token: torch.Tensor  # (G, Lq) row of q of each padded query
    q_valid: torch.Tensor  # (G, Lq)
    k_token: torch.Tensor  # (G, Lk)
    k_valid: torch.Tensor  # (G, Lk)
    scores: torch.Tensor  # (G, H, Lq, Lk) scale * q k^T
    mask: torch.Tensor  # (G, 1, Lq, Lk) bool
    coef: torch.Tensor  # (G, 1, 1, 1) output_scale * normalisation


def _load_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: _Pairs,
    group: tuple[torch.Tensor, int, int],
    spec: AttentionSpec,
    dtype: torch.dtype,
) -> _Group:
    table, lq_pad, lk_pad = group
    pair, q_lo, q_n, k_head, k_lo, k_n = (col[:, None] for col in table.unbind(1))
    i = torch.arange(lq_pad, device=q.device)
    j = torch.arange(lk_pad, device=q.device)
    q_pos, q_valid = q_lo + i, i < q_n  # (G, Lq) positions within the query sequence
    k_pos, k_valid = torch.where(j < k_head, j, k_lo + j - k_head), j < k_n
    q_token = pairs.q_start[pair] + q_pos
    k_token = pairs.k_start[pair] + k_pos

    qg = _gather(q, q_token, q_valid, dtype)
    kg = _gather(k, k_token, k_valid, dtype)
    vg = _gather(v, k_token, k_valid, dtype)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * spec.scale

    col = pair.view(-1, 1, 1, 1)
    targets = None if pairs.targets is None else pairs.targets[col]
    mask = allowed(
        q_pos[:, None, :, None], k_pos[:, None, None, :], pairs.q_len[col], pairs.k_len[col],
        targets, spec.mask,
    )  # fmt: skip
    mask = mask & q_valid[:, None, :, None] & k_valid[:, None, None, :]

    k_len = pairs.k_len[pair.view(-1)]
    if spec.normalization == "none":
        norm = torch.ones_like(k_len, dtype=dtype)
    elif spec.normalization == "max_seqlen":
        norm = torch.full_like(k_len, 1.0 / max(spec.max_seqlen_kv, 1), dtype=dtype)
    else:  # "length": tiles only exist for pairs with keys
        norm = 1.0 / k_len.to(dtype)
    coef = (spec.output_scale * norm).view(-1, 1, 1, 1)
    return _Group(qg, kg, vg, q_token, q_valid, k_token, k_valid, scores, mask, coef)


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the allowed keys; rows without any allowed key are all zero."""
    masked = scores.masked_fill(~mask, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    # exp(-inf) = 0 for masked keys, so they never enter the denominator.
    e = torch.exp(masked - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    return e / torch.where(denom > 0, denom, 1.0)


def _weights(g: _Group, spec: AttentionSpec) -> torch.Tensor:
    """``w_ij`` of the spec (before ``coef``), zero on masked pairs."""
    if spec.activation == "softmax":
        return _masked_softmax(g.scores, g.mask)
    return torch.where(g.mask, activation(spec.activation, g.scores), 0.0)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _without_autocast(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` with autocast off for its inputs' device.

    The reference computes in float32 (float64 for float64 inputs) on purpose; under an
    ambient ``torch.autocast`` its matmuls would silently drop to bf16/fp16 and mix dtypes.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        device_type = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


@_without_autocast
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    *,
    kv_index: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference forward of the attention defined by ``spec``.

    Args:
        q: ``(Tq, H, D)`` queries of all query sequences, concatenated.
        k: ``(Tk, H, D)`` keys; v: ``(Tk, H, Dv)`` values.
        q_offsets: ``(Bq + 1,)`` int; query sequence ``b`` is ``q[q_offsets[b]:q_offsets[b+1]]``.
        kv_offsets: ``(Bk + 1,)`` int, the same for keys and values.
        spec: scale, activation, normalisation and mask.
        kv_index: ``(Bq,)`` int, the kv sequence of each query sequence (default: ``b``).
        num_targets: ``(Bq,)`` int, HSTU targets per pair (default: none).

    Returns:
        ``(Tq, H, Dv)`` in ``q.dtype``; computed in float32 (float64 for float64 inputs).
        Differentiable by autograd in ``q``, ``k`` and ``v``.
    """
    dtype = _compute_dtype(q.dtype)
    pairs = _pairs(q_offsets, kv_offsets, kv_index, num_targets)
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]), dtype=dtype)
    tokens, rows = [], []
    for group in _groups(pairs, spec, q.shape[1]):
        g = _load_group(q, k, v, pairs, group, spec, dtype)
        o = torch.matmul(_weights(g, spec) * g.coef, g.v).transpose(1, 2)  # (G, Lq, H, Dv)
        tokens.append(g.q_token[g.q_valid])
        rows.append(o[g.q_valid])
    if tokens:
        # Out-of-place so that autograd through the reference works.
        out = out.index_put((torch.cat(tokens),), torch.cat(rows))
    return out.to(q.dtype)


@_without_autocast
def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    spec: AttentionSpec,
    *,
    kv_index: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward: ``(dq, dk, dv)`` for the upstream gradient ``grad_out``.

    Args:
        grad_out: ``(Tq, H, Dv)`` gradient of the loss w.r.t. the output.
        q, k, v, q_offsets, kv_offsets, spec, kv_index, num_targets: as in
            :func:`attention_forward`.

    Returns:
        ``dq`` ``(Tq, H, D)``, ``dk`` ``(Tk, H, D)``, ``dv`` ``(Tk, H, Dv)`` in the dtypes of
        ``q``, ``k``, ``v``. With a ``kv_index`` that maps several query sequences to one
        kv sequence, their contributions to ``dk``/``dv`` add up.

    The formulas, with ``W = coef * w`` (see :mod:`~hyperrec.jagged_attn.spec`)::

        dV = W^T dO;    dW = coef * dO V^T
        dS = w * (dW - rowsum(dW * w))           softmax
        dS = dW * act'(S) on allowed pairs       element-wise activations
        dQ = scale * dS K;    dK = scale * dS^T Q
    """
    dtype = _compute_dtype(q.dtype)
    pairs = _pairs(q_offsets, kv_offsets, kv_index, num_targets)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for group in _groups(pairs, spec, q.shape[1]):
        g = _load_group(q, k, v, pairs, group, spec, dtype)
        do = _gather(grad_out, g.q_token, g.q_valid, dtype)
        w = _weights(g, spec)
        dv_g = torch.matmul((w * g.coef).transpose(-1, -2), do)
        dw = torch.matmul(do, g.v.transpose(-1, -2)) * g.coef
        if spec.activation == "softmax":
            ds = w * (dw - (dw * w).sum(dim=-1, keepdim=True))
        else:
            ds = torch.where(g.mask, dw * activation_derivative(spec.activation, g.scores), 0.0)
        dq_g = torch.matmul(ds, g.k) * spec.scale
        dk_g = torch.matmul(ds.transpose(-1, -2), g.q) * spec.scale
        # A query row lies in exactly one tile; a key may serve several tiles (neighbouring
        # blocks, the contextual prefix, or query sequences sharing it through kv_index).
        dq[g.q_token[g.q_valid]] = dq_g.transpose(1, 2)[g.q_valid]
        dk.index_add_(0, g.k_token[g.k_valid], dk_g.transpose(1, 2)[g.k_valid])
        dv.index_add_(0, g.k_token[g.k_valid], dv_g.transpose(1, 2)[g.k_valid])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
