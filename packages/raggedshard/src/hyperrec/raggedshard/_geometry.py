"""Pure index arithmetic shared by the placement, the collectives and DCP (no torch state).

Conventions: a *row* of a tensor sharded by ``RaggedShard(dims=(0..k-1), units)`` is one
index of its leading ``k`` dims flattened (``k = 0``: the whole tensor is one row).
Bounds are half-open ``(start, end)`` pairs, one per rank of a mesh axis, in rank order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Bounds = tuple[tuple[int, int], ...]


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (size-0 dims count as 1, like ``torch.empty``)."""
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def prefix_bounds(counts: Sequence[int], scale: int = 1) -> Bounds:
    """``[(0, c0), (c0, c0 + c1), ...]`` scaled by ``scale``."""
    out = []
    start = 0
    for c in counts:
        out.append((start * scale, (start + c) * scale))
        start += c
    return tuple(out)


def chunk_bounds(size: int, parts: int) -> Bounds:
    """Per-part ranges of ``torch.chunk(size, parts)``; trailing parts may be empty.

    This is the semantics of upstream ``Shard(d)``: chunk ``ceil(size / parts)``.
    """
    chunk = -(-size // parts) if size else 0
    out = []
    for j in range(parts):
        start = min(j * chunk, size)
        out.append((start, min(start + chunk, size)))
    return tuple(out)


def chunk_owner_count(lo: int, hi: int, stride: int, size: int, c0: int, c1: int) -> int:
    """How many flat indices ``g`` in ``[lo, hi)`` have ``(g // stride) % size`` in ``[c0, c1)``.

    Used to size all-to-all messages between a flat range (ragged side) and a chunk of a
    dim (``Shard(d)`` side) without materialising any index tensor.
    """
    if hi <= lo or c1 <= c0 or stride == 0 or size == 0:
        return 0
    period = stride * size
    inside = (c1 - c0) * stride

    def upto(x: int) -> int:
        q, r = divmod(x, period)
        return q * inside + min(max(r - c0 * stride, 0), inside)

    return upto(hi) - upto(lo)


def row_range_boxes(
    leading: Sequence[int], start: int, end: int
) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Cut the flat row range ``[start, end)`` of index space ``leading`` into boxes.

    A flat range of a row-major ``k``-dim index space is a union of at most
    ``2 * (k - 1) + 1`` axis-aligned boxes, each itself a contiguous sub-range. DCP
    stores chunks as boxes (offsets + sizes), so this is how a ragged shard becomes
    checkpoint chunks.

    Returns:
        ``[(offsets, sizes, first_row), ...]`` in row order; ``first_row`` is the flat row
        at which the box starts (so ``rows[first_row - start : ...]`` is its data).
    """
    leading = tuple(leading)
    if end <= start:
        return []
    if not leading:
        return [((), (), start)]
    inner = math.prod(leading[1:])
    if inner == 0:
        return []
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(end, inner)
    if i0 == i1:
        for offs, sizes, first in row_range_boxes(leading[1:], r0, r1):
            out.append(((i0, *offs), (1, *sizes), i0 * inner + first))
        return out
    cur = i0
    if r0:
        for offs, sizes, first in row_range_boxes(leading[1:], r0, inner):
            out.append(((i0, *offs), (1, *sizes), i0 * inner + first))
        cur = i0 + 1
    if i1 > cur:
        out.append(((cur, *([0] * (len(leading) - 1))), (i1 - cur, *leading[1:]), cur * inner))
    if r1:
        for offs, sizes, first in row_range_boxes(leading[1:], 0, r1):
            out.append(((i1, *offs), (1, *sizes), i1 * inner + first))
    return out
