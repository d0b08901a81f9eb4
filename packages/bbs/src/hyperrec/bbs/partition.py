"""Equal-cardinality balanced partitioning: split ``m * k`` costs into ``m`` parts of ``k``.

This is the combinatorial core of BBS. A rank's window of ``W`` steps is one instance
(``m = W`` parts = steps, ``k`` sub-batches per step); the global mode and the oracle
are one instance with ``m = world_size * W``. Every algorithm here is batched over a
leading axis so the simulator can solve thousands of ranks' windows in one numpy call,
and the single-rank public API runs the very same code with a batch of one.

Algorithms (``method=``):

- ``"snake"``: sort descending and deal serpentine (0..m-1, m-1..0, ...). The
  "heaviest with lightest" deal described for GEM; the weakest baseline here.
- ``"lpt"``: ``k`` rounds of the ``m`` next-largest items; each round gives its
  largest item to the currently lightest part (longest-processing-time with the
  cardinality constraint).
- ``"kk"``: balanced largest differencing (Karmarkar-Karp with equal-size sets): every
  round of ``m`` sorted items starts as a partial partition; repeatedly the two partial
  partitions with the largest spread (max - min) are merged, heaviest set of one with
  the lightest set of the other, so their spreads cancel.
- ``"kk_swap"`` / ``"lpt_swap"``: the above, then local search that swaps one item
  between the heaviest and the lightest part while that strictly lowers the larger of
  the two; the sum of squared loads falls at every swap, so it ends.
- ``"auto"``: ``"kk_swap"`` (best, tied with ``"lpt_swap"``, on every distribution
  measured in ``bench/``).

All are deterministic: stable sorts, ties broken by index, no randomness.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperrec.bbs._validate import as_costs, check_choice, check_int

__all__ = ["METHODS", "balance", "part_loads", "rescaled"]

METHODS = ("auto", "snake", "lpt", "kk", "lpt_swap", "kk_swap")


def balance(
    costs: Any,
    num_parts: int,
    *,
    method: str = "auto",
    max_swaps: int | None = None,
) -> np.ndarray:
    """Split costs into ``num_parts`` parts of equal size with balanced sums.

    Args:
        costs: ``(n,)`` or batched ``(B, n)`` non-negative finite costs (any real
            dtype; numpy, torch or a sequence). ``n`` must be a multiple of
            ``num_parts``; each part gets ``k = n // num_parts`` items.
        num_parts: number of parts ``m >= 1``.
        method: one of :data:`METHODS` (default ``"auto"`` = ``"kk_swap"``).
        max_swaps: cap on local-search swaps per instance for the ``*_swap`` methods
            (default ``4 * num_parts``, at most 256).

    Returns:
        int64 array of item indices, ``(m, k)`` (or ``(B, m, k)``): part ``j`` holds
        items ``out[..., j, :]``. Canonical order: indices ascending within a part,
        parts ordered by their smallest index. Every index appears exactly once.

    Raises:
        TypeError: non-numeric ``costs``, non-int ``num_parts``/``max_swaps``.
        ValueError: negative/NaN/inf costs, ``costs`` not 1-D/2-D, ``n`` not a
            multiple of ``num_parts``, ``num_parts < 1``, unknown ``method``.
    """
    arr = as_costs("costs", costs, ndim=(1, 2))
    m = check_int("num_parts", num_parts, minimum=1)
    check_choice("method", method, METHODS)
    if max_swaps is not None:
        max_swaps = check_int("max_swaps", max_swaps, minimum=0)
    single = arr.ndim == 1
    batch = arr[None] if single else arr
    n = batch.shape[1]
    if n % m:
        raise ValueError(f"costs has {n} items per instance, not a multiple of num_parts={m}")
    out = balance_batched(batch, m, method=method, max_swaps=max_swaps)
    return out[0] if single else out


def balance_batched(
    costs: np.ndarray, m: int, *, method: str = "auto", max_swaps: int | None = None
) -> np.ndarray:
    """:func:`balance` without validation: ``costs`` float64 ``(B, m*k)`` -> ``(B, m, k)``."""
    b, n = costs.shape
    k = n // m
    if n == 0 or b == 0:
        return np.zeros((b, m, k), dtype=np.int64)
    costs = rescaled(costs)
    if method == "auto":
        method = "kk_swap"
    base = method.removesuffix("_swap")
    if base == "snake":
        bins = _snake(costs, m)
    elif base == "lpt":
        bins = _lpt(costs, m)
    else:
        bins = _kk(costs, m)
    members = np.argsort(bins, axis=1, kind="stable").reshape(b, m, k)
    if method.endswith("_swap") and m > 1 and k > 0:
        swaps = min(4 * m, 256) if max_swaps is None else max_swaps
        _swap_refine(costs, members, swaps)
    return _canonical(members)


def rescaled(costs: np.ndarray) -> np.ndarray:
    """``costs (B, n)`` with each row divided by the power of two that brings its max
    into ``[0.5, 1)`` (rows of zeros unchanged).

    Every decision here compares sums of costs, and those comparisons do not depend on
    the scale; a power of two rescales exactly (but for subnormal results), so plans are
    unchanged, except that sums of huge finite costs (near 1e308) no longer overflow
    to inf, where every part looked equally loaded and balancing silently stopped.
    """
    if costs.size == 0:
        return costs
    exponent = np.frexp(costs.max(axis=1, keepdims=True))[1]
    return np.ldexp(costs, -exponent)


def part_loads(costs: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Sum of each part: ``costs (B, n)``, ``members (B, m, k)`` -> ``(B, m)`` float64."""
    b, m, k = members.shape
    gathered = np.take_along_axis(costs, members.reshape(b, m * k), axis=1)
    return gathered.reshape(b, m, k).sum(axis=2)


def _descending(costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Stable sort of the negated costs: equal costs keep their index order.
    order = np.argsort(-costs, axis=1, kind="stable")
    return order, np.take_along_axis(costs, order, axis=1)


def _scatter(order: np.ndarray, sorted_bins: np.ndarray) -> np.ndarray:
    bins = np.empty_like(sorted_bins)
    np.put_along_axis(bins, order, sorted_bins, axis=1)
    return bins


def _snake(costs: np.ndarray, m: int) -> np.ndarray:
    b, n = costs.shape
    order, _ = _descending(costs)
    pos = np.arange(n)
    rnd, col = pos // m, pos % m
    sorted_bins = np.where(rnd % 2 == 0, col, m - 1 - col)
    return _scatter(order, np.broadcast_to(sorted_bins, (b, n)).copy())


def _lpt(costs: np.ndarray, m: int) -> np.ndarray:
    b, n = costs.shape
    order, sc = _descending(costs)
    loads = np.zeros((b, m))
    sorted_bins = np.empty((b, n), dtype=np.int64)
    rows = np.arange(b)[:, None]
    for r in range(n // m):
        # The round's items are descending, so the lightest part gets the largest one.
        lightest_first = np.argsort(loads, axis=1, kind="stable")
        loads[rows, lightest_first] += sc[:, r * m : (r + 1) * m]
        sorted_bins[:, r * m : (r + 1) * m] = lightest_first
    return _scatter(order, sorted_bins)


def _kk(costs: np.ndarray, m: int) -> np.ndarray:
    b, n = costs.shape
    k = n // m
    order, sc = _descending(costs)
    # Partial partition j = the j-th round of m sorted items, one item per set. For
    # every sorted item we track which partial partition ("slot") and which set
    # within it ("col") holds it; merging renumbers cols.
    loads = sc.reshape(b, k, m).copy()
    pos = np.arange(n)
    slot = np.broadcast_to(pos // m, (b, n)).copy()
    col = np.broadcast_to(pos % m, (b, n)).copy()
    alive = np.ones((b, k), dtype=bool)
    rows = np.arange(b)
    for _ in range(k - 1):
        spread = np.where(alive, loads.max(axis=2) - loads.min(axis=2), -np.inf)
        i1 = spread.argmax(axis=1)
        spread[rows, i1] = -np.inf
        i2 = spread.argmax(axis=1)
        a, c = loads[rows, i1], loads[rows, i2]
        pa = np.argsort(a, axis=1, kind="stable")  # lightest set of the first ...
        pc = np.argsort(-c, axis=1, kind="stable")  # ... meets the heaviest of the second
        loads[rows, i1] = np.take_along_axis(a, pa, 1) + np.take_along_axis(c, pc, 1)
        new_a, new_c = np.argsort(pa, axis=1), np.argsort(pc, axis=1)
        in1, in2 = slot == i1[:, None], slot == i2[:, None]
        col = np.where(
            in1,
            np.take_along_axis(new_a, col, 1),
            np.where(in2, np.take_along_axis(new_c, col, 1), col),
        )
        slot = np.where(in2, i1[:, None], slot)
        alive[rows, i2] = False
    return _scatter(order, col)


def _swap_refine(costs: np.ndarray, members: np.ndarray, max_swaps: int) -> None:
    """In place: swap one item between the heaviest and the lightest part while the
    larger of the two strictly drops (then the sum of squared loads drops too, so the
    search ends). Wider searches (heaviest vs the 4 or 16 lightest parts, or all
    heavy/light pairs at once) measured no better on the simulator's workloads."""
    b, m, k = members.shape
    loads = part_loads(costs, members)
    active = np.arange(b)
    for _ in range(max_swaps):
        if active.size == 0:
            break
        rows = np.arange(active.size)
        lo = loads[active]
        h, l = lo.argmax(axis=1), lo.argmin(axis=1)
        lh, ll = lo[rows, h], lo[rows, l]
        mem, c = members[active], costs[active]
        ch = np.take_along_axis(c, mem[rows, h], 1)  # (a, k)
        cl = np.take_along_axis(c, mem[rows, l], 1)
        d = ch[:, :, None] - cl[:, None, :]  # cost moved from the heaviest part
        new_max = np.maximum(lh[:, None, None] - d, ll[:, None, None] + d)
        new_max = np.where(d > 0, new_max, np.inf).reshape(active.size, k * k)
        j = new_max.argmin(axis=1)
        ok = new_max[rows, j] < lh - 1e-12 * np.abs(lh)
        if not ok.any():
            break
        r, xi, yi = active[ok], j[ok] // k, j[ok] % k
        hb, lb = h[ok], l[ok]
        item_x, item_y = members[r, hb, xi], members[r, lb, yi]
        members[r, hb, xi], members[r, lb, yi] = item_y, item_x
        moved = costs[r, item_x] - costs[r, item_y]
        loads[r, hb] -= moved
        loads[r, lb] += moved
        active = r


def _canonical(members: np.ndarray) -> np.ndarray:
    members = np.sort(members, axis=2)
    first = members[:, :, 0] if members.shape[2] else np.zeros(members.shape[:2], np.int64)
    order = np.argsort(first, axis=1, kind="stable")
    return np.take_along_axis(members, order[:, :, None], 1).astype(np.int64, copy=False)
