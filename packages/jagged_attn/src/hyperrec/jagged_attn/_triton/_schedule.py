"""Device-side tile schedules, never read on the host: the PyTorch builders and the cache.

(The default path builds the query-tile and self-attention key-tile schedules in one
Triton launch instead, ``_tiles.py``, with the same tiles and cost order; the builders
here serve the opt-in variants, dK/dV with a ``kv_index``, and the tests.)

A schedule lists the work of one kernel as tiles, sorted by estimated cost, heaviest first:

* ``tile_seq`` (int32, U): the sequence of each tile;
* ``tile_idx`` (int32, U): the tile's index inside its sequence;
* ``total`` (int32, 1): how many of the U entries are real tiles (the rest sort last).

``U = total_tokens // block + n_seq`` is an upper bound on the tile count that follows
from tensor *shapes*, so the arrays are allocated and the grid is sized without reading a
length on the host. The kernel multiplies ``total`` by the number of heads to get its
work-item count. Cost per tile: the number of keys it visits (a query tile) or of queries
(a key tile), counting the causal triangle.

Schedules depend only on the offsets (and the query -> kv map), so they are cached per
offsets *object*: the many attention layers of one step, and their backward passes, reuse
one schedule. The cache holds weak references and checks PyTorch's version counter, so an
offsets tensor that is modified in place or freed is never served a stale schedule.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

__all__ = [
    "as_int32",
    "cached_schedule",
    "remember_int32",
    "kv_tile_schedule",
    "q_tile_meta",
    "q_tile_schedule",
    "row_sequence",
    "work_upper_bound",
]

_CACHE_SIZE = 64
# (ids of the tensors, extra) -> (weak references to them, their versions, the value)
_cache: OrderedDict[
    tuple[tuple[int, ...], tuple[object, ...]],
    tuple[tuple[weakref.ref[torch.Tensor] | None, ...], tuple[int, ...], Any],
] = OrderedDict()
_T = TypeVar("_T")


def _cached(
    tensors: tuple[torch.Tensor | None, ...], extra: tuple[object, ...], build: Callable[[], _T]
) -> _T:
    if torch.compiler.is_compiling():
        return build()
    try:  # inference tensors carry no version counter: never cached
        versions = tuple([-1 if t is None else t._version for t in tensors])
    except RuntimeError:
        return build()
    key = (tuple([id(t) for t in tensors]), extra)
    hit = _cache.get(key)
    if hit is not None:
        refs, old_versions, value = hit
        if old_versions == versions:
            for r, t in zip(refs, tensors):
                if (r() is not t) if r is not None else (t is not None):
                    break
            else:
                _cache.move_to_end(key)
                return value
    value = build()
    refs = tuple([None if t is None else weakref.ref(t) for t in tensors])
    _cache[key] = (refs, versions, value)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return value


def cached_schedule(
    tensors: tuple[torch.Tensor | None, ...], extra: tuple[object, ...], build: Callable[[], _T]
) -> _T:
    """``build()``, cached per the index tensors' identities and versions and ``extra``
    (see the module doc): what the launchers use to keep one schedule per offsets object."""
    return _cached(tensors, extra, build)


@overload
def as_int32(t: torch.Tensor) -> torch.Tensor: ...
@overload
def as_int32(t: None) -> None: ...


def as_int32(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as int32 (cached per object), so kernel index arithmetic stays 32-bit."""
    if t is None or t.dtype == torch.int32:
        return t
    return _cached((t,), ("int32",), lambda: t.to(torch.int32))


def remember_int32(t: torch.Tensor, t32: torch.Tensor) -> None:
    """Make ``t32`` (an int32 copy of ``t`` written elsewhere, e.g. by the schedule
    kernel) what :func:`as_int32` returns for ``t`` from now on."""
    if t.dtype != torch.int32:
        _cached((t,), ("int32",), lambda: t32)


def row_sequence(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """``(total,)`` int32: the sequence each token row belongs to (cached per offsets)."""

    def build():
        rows = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
        return torch.searchsorted(offsets[1:].contiguous(), rows, right=True).to(torch.int32)

    return _cached((offsets,), ("rows", total), build)


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    return (offsets[1:] - offsets[:-1]).to(torch.int64)


def work_upper_bound(total_tokens: int, n_seq: int, block: int) -> int:
    """Tiles of ``block`` rows over sequences of ``total_tokens`` rows: sum ceil(L / block)
    <= total // block + n_seq. A bound from shapes only (never fewer than 1)."""
    return max(1, total_tokens // block + n_seq)


def _tile_table(
    tiles: torch.Tensor, upper: int, cost_fn, order: str = "cost"
) -> tuple[torch.Tensor, ...]:
    """(tile_seq, tile_idx, total) for ``tiles[s]`` tiles per sequence, sorted by cost.

    ``cost_fn(seq, idx)`` gives the cost of tile ``idx`` of sequence ``seq`` (int64).
    ``order="cost"`` sorts every tile by its own cost; ``"sequence"`` sorts sequences by
    their total cost and keeps each sequence's tiles together (heaviest tile first).
    """
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(upper, device=tiles.device)
    # tile t belongs to the first sequence whose inclusive prefix sum exceeds t (empty
    # sequences never do); entries past the real tiles are parked on the last sequence
    seq = torch.searchsorted(cum, t, right=True).clamp_(max=tiles.numel() - 1)
    idx = t - (cum[seq] - tiles[seq])
    real = t < cum[-1]
    cost = torch.where(real, cost_fn(seq, idx), -1)
    perm = torch.argsort(cost, descending=True, stable=True)
    if order == "sequence":
        n = tiles.numel()
        seq_cost = torch.zeros(n, dtype=cost.dtype, device=cost.device)
        seq_cost.index_add_(0, seq, cost.clamp(min=0))
        # primary key: the sequence's total cost (ties broken by sequence, so a sequence's
        # tiles stay together); a stable sort keeps the per-tile order within a sequence
        key = torch.where(real, seq_cost[seq] * n + (n - 1 - seq), -1)
        perm = perm[torch.argsort(key[perm], descending=True, stable=True)]
    total = cum[-1:].to(torch.int32)
    return seq[perm].to(torch.int32), idx[perm].to(torch.int32), total


def q_tile_schedule(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    block_m: int,
    causal: bool,
    total_q: int,
    order: str = "cost",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_seq, tile_idx, total) over ``block_m`` query tiles (``total_q`` = q.shape[0]),
    in ``order`` (see :func:`_tile_table`)."""

    def build():
        lq = _lengths(q_offsets)
        lk = _lengths(kv_offsets)
        lk_q = lk if kv_index is None else lk[kv_index.long()]
        tiles = (lq + block_m - 1) // block_m
        upper = work_upper_bound(total_q, q_offsets.numel() - 1, block_m)

        def cost(seq, idx):
            keys = lk_q[seq]
            if causal:  # keys up to the tile's last row on the bottom-right diagonal
                last = torch.minimum((idx + 1) * block_m, lq[seq]) + keys - lq[seq]
                keys = torch.minimum(keys, last).clamp_(min=0)
            return keys + block_m  # + a fixed per-tile overhead

        return _tile_table(tiles, upper, cost, order)

    key = ("q", block_m, causal, total_q, order)
    return _cached((q_offsets, kv_offsets, kv_index), key, build)


def q_tile_meta(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    num_targets: torch.Tensor | None,
    block_m: int,
    causal: bool,
    total_q: int,
    order: str = "cost",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(meta, total): :func:`q_tile_schedule` with each tile's geometry resolved.

    ``meta`` is ``(U, 8)`` int32, one 32-byte row per tile in schedule order: query start,
    query length, kv start, kv length, first query row, number of targets (0 without
    targets), query sequence, 0. A kernel reads a work item with independent loads of one
    row instead of the dependent chain tile -> sequence -> offsets (-> kv map).
    """

    def build():
        tile_seq, tile_idx, total = q_tile_schedule(
            q_offsets, kv_offsets, kv_index, block_m, causal, total_q, order
        )
        seq = tile_seq.long()
        kb = seq if kv_index is None else kv_index.long()[seq]
        q_start = q_offsets.long()[seq]
        k_start = kv_offsets.long()[kb]
        meta = torch.zeros(seq.numel(), 8, dtype=torch.int32, device=seq.device)
        meta[:, 0] = q_start
        meta[:, 1] = q_offsets.long()[seq + 1] - q_start
        meta[:, 2] = k_start
        meta[:, 3] = kv_offsets.long()[kb + 1] - k_start
        meta[:, 4] = tile_idx * block_m
        if num_targets is not None:
            meta[:, 5] = num_targets.long()[seq]
        meta[:, 6] = tile_seq
        return meta, total

    return _cached(
        (q_offsets, kv_offsets, kv_index, num_targets),
        ("qmeta", block_m, causal, total_q, order),
        build,
    )


def kv_tile_schedule(
    q_offsets: torch.Tensor,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    block_n: int,
    causal: bool,
    total_kv: int,
) -> tuple[torch.Tensor, ...]:
    """(tile_seq, tile_idx, total, inv_ptr, inv_idx) over ``block_n`` key tiles.

    ``inv_ptr``/``inv_idx`` are the inverse of ``kv_index`` in CSR form: the query sequences
    that read kv sequence ``kb`` are ``inv_idx[inv_ptr[kb]:inv_ptr[kb + 1]]``. Without a map
    they are placeholders (the kernel pairs each kv sequence with its own queries).
    """

    def build():
        lq = _lengths(q_offsets)
        lk = _lengths(kv_offsets)
        tiles = (lk + block_n - 1) // block_n
        upper = work_upper_bound(total_kv, kv_offsets.numel() - 1, block_n)
        if kv_index is None:
            rows = lq
            inv_ptr = inv_idx = torch.zeros(1, dtype=torch.int32, device=lq.device)
        else:
            idx = kv_index.long()
            rows = torch.zeros_like(lk).index_add_(0, idx, lq)
            counts = torch.zeros_like(lk).index_add_(0, idx, torch.ones_like(lq))
            inv_ptr = torch.zeros(lk.numel() + 1, dtype=torch.int32, device=lk.device)
            inv_ptr[1:] = torch.cumsum(counts, 0)
            inv_idx = torch.argsort(idx, stable=True).to(torch.int32)

        def cost(seq, tile):
            r = rows[seq]
            if causal and kv_index is None:  # queries at or below the tile's first key
                first_row = (tile * block_n - (lk[seq] - lq[seq])).clamp(min=0)
                r = (lq[seq] - first_row).clamp_(min=0)
            return r + block_n

        return (*_tile_table(tiles, upper, cost), inv_ptr, inv_idx)

    return _cached((q_offsets, kv_offsets, kv_index), ("kv", block_n, causal, total_kv), build)
