"""The Gluon forward's work list: a device-side table of query tiles, heaviest first.

A work item of the kernel is one ``block_m``-row query tile of one sequence and one head.
This module builds, with a few tensor ops and without reading a length on the host, the
table the kernel walks:

* ``meta``: int32 ``(U, 8)``, one 32-byte row per tile: query start, query length, key
  start, key length, first query row of the tile, then three zeros (padding to 32 bytes);
  rows sorted by estimated cost, descending (longest-processing-time first: long
  sequences and the causal tiles far below the diagonal start early, short ones fill the
  tail of the persistent loop);
* ``total``: int32 ``(1,)``, how many rows of ``meta`` are real tiles.

``U = total_q // block_m + n_seq`` bounds the tile count from shapes alone
(``sum ceil(L / block_m) <= sum L / block_m + n_seq``), so allocation and the grid size
need no device sync. Rows past ``total`` are never used as work (the kernel clamps reads).

Tables depend only on the offsets, so they are cached per offsets *object* (weak
references plus PyTorch's version counter: an offsets tensor that is modified in place or
freed never gets a stale table). The many attention layers of one step share one table.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

__all__ = ["tile_table", "upper_bound"]

_CACHE_SIZE = 16
# (ids of the offsets, block_m, causal, total_q) ->
# (weak references to the offsets, their versions, the table)
_cache: OrderedDict[
    tuple[int, int, int, bool, int],
    tuple[
        tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]],
        tuple[int | None, int | None],
        tuple[torch.Tensor, torch.Tensor],
    ],
] = OrderedDict()


def upper_bound(total_q: int, n_seq: int, block_m: int) -> int:
    """Rows of the tile table: an upper bound on the number of tiles (at least 1)."""
    return max(1, total_q // block_m + n_seq)


def _build(
    q_offsets: torch.Tensor, kv_offsets: torch.Tensor, block_m: int, causal: bool, total_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    qo = q_offsets.long()
    ko = kv_offsets.long()
    n_seq = qo.numel() - 1
    lq = qo[1:] - qo[:-1]
    lk = ko[1:] - ko[:-1]
    tiles = (lq + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    rows = upper_bound(total_q, n_seq, block_m)
    t = torch.arange(rows, device=qo.device)
    # tile t belongs to the first sequence whose inclusive prefix sum exceeds t (empty
    # sequences never do); rows past the real tiles are parked on the last sequence
    seq = torch.searchsorted(cum, t, right=True).clamp_(max=n_seq - 1)
    idx = t - (cum[seq] - tiles[seq])
    m0 = idx * block_m
    keys = lk[seq]
    if causal:  # keys up to the tile's last row on the bottom-right diagonal
        last = torch.minimum(m0 + block_m, lq[seq]) + keys - lq[seq]
        keys = torch.minimum(keys, last).clamp_(min=0)
    cost = torch.where(t < cum[-1], keys + block_m, -1)  # + a fixed per-tile overhead
    order = torch.argsort(cost, descending=True, stable=True)
    seq, m0 = seq[order], m0[order]
    meta = torch.zeros(rows, 8, dtype=torch.int32, device=qo.device)
    meta[:, 0] = qo[seq]
    meta[:, 1] = lq[seq]
    meta[:, 2] = ko[seq]
    meta[:, 3] = lk[seq]
    meta[:, 4] = m0
    return meta, cum[-1:].to(torch.int32)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter: never cached
        return None


def tile_table(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    block_m: int,
    causal: bool,
    total_q: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(meta, total)`` for query tiles of ``block_m`` rows (see the module doc).

    ``q_offsets``/``kv_offsets``: ``(B + 1,)`` int32/int64 with ``B >= 1``; ``total_q`` is
    ``q.shape[0]`` (it sizes the table; the offsets' values are never read on the host).
    """
    if torch.compiler.is_compiling():
        return _build(q_offsets, kv_offsets, block_m, causal, total_q)
    versions = (_version(q_offsets), _version(kv_offsets))
    if None in versions:
        return _build(q_offsets, kv_offsets, block_m, causal, total_q)
    key = (id(q_offsets), id(kv_offsets), block_m, causal, total_q)
    hit = _cache.get(key)
    if hit is not None:
        refs, old_versions, value = hit
        if refs[0]() is q_offsets and refs[1]() is kv_offsets and old_versions == versions:
            _cache.move_to_end(key)
            return value
    value = _build(q_offsets, kv_offsets, block_m, causal, total_q)
    _cache[key] = ((weakref.ref(q_offsets), weakref.ref(kv_offsets)), versions, value)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value
