"""Index arithmetic on a raggedshard ``Layout``: who holds which elements of which tensor.

A layout places tensor ``i`` at ``[offsets[i], offsets[i] + numels[i])`` of a flat,
rank-major buffer of ``world_size * shard_numel`` elements; rank ``r`` holds
``[r * shard_numel, (r + 1) * shard_numel)``. Everything here is pure integer work,
done once when a buffer is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Placement", "place", "uncovered"]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one tensor lives in the flat buffer, and which part each rank holds."""

    offset: int
    """Start of the tensor in the flat full buffer (elements)."""
    numel: int
    """Number of elements of the tensor."""
    ranges: tuple[tuple[int, int], ...]
    """``ranges[r] = (start, stop)``: the tensor's flat elements held by rank ``r``
    (``start == stop`` for a rank holding none). Consecutive and covering ``[0, numel)``."""

    def local(self, rank: int, shard_numel: int) -> tuple[int, int]:
        """``(start, stop)`` of this tensor's piece inside rank ``rank``'s shard storage."""
        start, stop = self.ranges[rank]
        if start == stop:
            return 0, 0  # holds none of it: an empty slice at the front
        base = self.offset - rank * shard_numel
        return base + start, base + stop


def place(
    numels: Sequence[int], offsets: Sequence[int], shard_numel: int, world_size: int
) -> list[Placement]:
    """Per-tensor placements from a layout's offsets.

    Raises:
        ValueError: the offsets overlap or leave the buffer (a planner bug, reported
            loudly rather than corrupting parameters).
    """
    if len(numels) != len(offsets):
        raise ValueError(f"layout has {len(offsets)} offsets for {len(numels)} tensors")
    total = world_size * shard_numel
    spans = sorted((o, o + n, i) for i, (o, n) in enumerate(zip(offsets, numels)) if n > 0)
    for (_, stop, i), (start, _, j) in zip(spans, spans[1:]):
        if start < stop:
            raise ValueError(f"layout overlaps tensors {i} and {j}")
    out = []
    for o, n in zip(offsets, numels):
        if o < 0 or o + n > total:
            raise ValueError(f"layout puts [{o}, {o + n}) outside a buffer of {total} elements")
        ranges = []
        for r in range(world_size):
            lo = min(max(o, r * shard_numel), o + n)
            hi = max(min(o + n, (r + 1) * shard_numel), lo)
            ranges.append((lo - o, hi - o))
        out.append(Placement(offset=o, numel=n, ranges=tuple(ranges)))
    return out


def uncovered(placements: Sequence[Placement], lo: int, hi: int) -> list[tuple[int, int]]:
    """Maximal sub-ranges of ``[lo, hi)`` of the flat buffer that hold no tensor (padding)."""
    spans = sorted((p.offset, p.offset + p.numel) for p in placements if p.numel > 0)
    gaps, pos = [], lo
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < hi:
        gaps.append((pos, hi))
    return gaps
