"""Window plans: which sub-batches each step trains on.

Vocabulary used throughout the package:

- A *sub-batch* is the reader's unit (e.g. 128 samples); a *step* trains on ``k``
  sub-batches per rank (``sub_batches_per_step``).
- The *natural step* of the sub-batch at arrival index ``i`` is ``i // k``: the step
  that would train it without BBS (in the global mode, ``i // (world_size * k)``).
- The *delay* of a sub-batch is ``trained step - natural step``. Plans only move a
  sub-batch inside its window of ``W`` steps, so ``|delay| <= W - 1`` for every
  sub-batch: it is trained at most ``W - 1`` steps late, or early.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperrec.bbs._validate import as_costs, check_choice, check_int
from hyperrec.bbs.partition import METHODS, balance_batched, rescaled

__all__ = ["global_shuffle_plan", "natural_steps", "shuffle_plan"]


def shuffle_plan(
    costs: Any,
    *,
    sub_batches_per_step: int,
    window_steps: int,
    method: str = "auto",
) -> list[list[int]]:
    """Deal one window of sub-batches to its steps so every step costs about the same.

    Args:
        costs: ``(window_steps * sub_batches_per_step,)`` non-negative costs of the
            window's sub-batches in arrival order (numpy, torch or a sequence).
        sub_batches_per_step: ``k >= 1`` sub-batches trained per step.
        window_steps: ``W >= 1`` steps per window (``W = 1`` returns arrival order).
        method: partition algorithm, see :data:`hyperrec.bbs.partition.METHODS`.

    Returns:
        ``W`` lists of ``k`` indices into ``costs``: step ``s`` of the window trains on
        ``plan[s]`` (ascending). Every index appears exactly once, every step gets
        exactly ``k`` sub-batches, ``|s - index // k| <= W - 1`` trivially, and steps
        are ordered by the mean arrival index of their sub-batches (freshest data
        last). If arrival order is already at least as balanced (largest step cost
        no higher), arrival order is returned. Deterministic: the same costs always
        give the same plan.

    Raises:
        TypeError: ``costs`` not numeric, ``sub_batches_per_step``/``window_steps`` not int.
        ValueError: negative/NaN/inf costs, ``len(costs) != window_steps *
            sub_batches_per_step``, either size < 1, unknown ``method``.
    """
    k = check_int("sub_batches_per_step", sub_batches_per_step, minimum=1)
    w = check_int("window_steps", window_steps, minimum=1)
    arr = as_costs("costs", costs, ndim=1)
    if arr.size != w * k:
        raise ValueError(
            f"costs must have window_steps * sub_batches_per_step = {w} * {k} = {w * k} "
            f"entries, got {arr.size}"
        )
    _check_method(method)
    return plan_windows(arr[None], k, w, method=method)[0].tolist()


def global_shuffle_plan(
    costs: Any,
    *,
    world_size: int,
    sub_batches_per_step: int,
    window_steps: int,
    method: str = "auto",
) -> list[list[list[int]]]:
    """The global mode: one window of every rank's sub-batches, dealt to (step, rank).

    For readers that share an index (every rank knows every sub-batch's cost): each
    rank calls this with the same ``costs`` and gets the same plan, then trains on its
    own row. No communication; sub-batches may move across ranks.

    Args:
        costs: ``(window_steps * world_size * sub_batches_per_step,)`` costs in natural
            order: entry ``i`` belongs to natural step ``i // (world_size * k)``.
        world_size: number of ranks ``R >= 1``.
        sub_batches_per_step: ``k >= 1`` per rank and step.
        window_steps: ``W >= 1``.
        method: partition algorithm (default ``"auto"``).

    Returns:
        ``plan[s][r]``: the ``k`` indices rank ``r`` trains on at step ``s`` of the
        window (ascending). Every index exactly once; ``|s - natural step| <= W - 1``.
        The ``W * R`` balanced groups are assigned heaviest first, ``R`` per step, so
        groups of similar load share a step (a step lasts as long as its heaviest).

    Raises:
        TypeError / ValueError: as :func:`shuffle_plan`, with ``world_size`` too.
    """
    r = check_int("world_size", world_size, minimum=1)
    k = check_int("sub_batches_per_step", sub_batches_per_step, minimum=1)
    w = check_int("window_steps", window_steps, minimum=1)
    arr = as_costs("costs", costs, ndim=1)
    if arr.size != w * r * k:
        raise ValueError(
            f"costs must have window_steps * world_size * sub_batches_per_step = "
            f"{w} * {r} * {k} = {w * r * k} entries, got {arr.size}"
        )
    _check_method(method)
    return plan_global_windows(arr[None], r, k, w, method=method)[0].tolist()


def natural_steps(num_items: int, per_step: int) -> np.ndarray:
    """``(num_items,)`` natural step of each arrival index (``i // per_step``).

    Raises:
        TypeError: ``num_items`` or ``per_step`` not an int.
        ValueError: ``num_items < 0`` or ``per_step < 1``.
    """
    n = check_int("num_items", num_items, minimum=0)
    p = check_int("per_step", per_step, minimum=1)
    return np.arange(n) // p


def plan_windows(costs: np.ndarray, k: int, w: int, *, method: str = "auto") -> np.ndarray:
    """Batched window plans: ``costs (B, w*k)`` float64 -> ``(B, w, k)`` step members.

    The workhorse behind :func:`shuffle_plan`, the streaming shuffler and the
    simulator (``B`` = ranks), so all three make identical decisions.
    """
    b = costs.shape[0]
    natural = np.broadcast_to(np.arange(w * k).reshape(w, k), (b, w, k))
    if w == 1:
        return natural.copy()
    costs = rescaled(costs)  # exact; keeps the step sums below from overflowing
    plan = _order_steps(balance_batched(costs, w, method=method))
    # Never move data when it does not help: keep arrival order wherever it is already
    # at least as balanced (e.g. equal costs), which keeps every delay at zero there.
    planned_max = _step_loads(costs, plan).max(axis=1)
    natural_max = costs.reshape(b, w, k).sum(axis=2).max(axis=1)
    keep = natural_max <= planned_max
    plan[keep] = natural[keep]
    return plan


def plan_global_windows(
    costs: np.ndarray, r: int, k: int, w: int, *, method: str = "auto"
) -> np.ndarray:
    """Batched global plans: ``costs (B, w*r*k)`` -> ``(B, w, r, k)`` (step, rank) members."""
    b = costs.shape[0]
    costs = rescaled(costs)  # exact; keeps the part sums below from overflowing
    parts = balance_batched(costs, w * r, method=method)
    # Heaviest parts share a step: a step lasts as long as its heaviest part, so
    # grouping parts by load minimises the summed step time of the window (any
    # grouping meets the delay bound). Stable sort: ties keep the canonical order.
    order = np.argsort(-_step_loads(costs, parts), axis=1, kind="stable")
    parts = np.take_along_axis(parts, order[:, :, None], axis=1)
    return parts.reshape(b, w, r, k)


def plan_partial_window(costs: np.ndarray, k: int, *, method: str = "auto") -> list[np.ndarray]:
    """Plan a short last window of ``n < W*k`` items: ``ceil(n / k)`` steps, the last
    ones possibly short (step sizes never increase). Zero-cost placeholders pad to a
    multiple of ``k`` and are dropped afterwards, so every real item appears exactly
    once."""
    n = costs.size
    steps = -(-n // k)
    padded = np.concatenate([costs, np.zeros(steps * k - n)])
    plan = plan_windows(padded[None], k, steps, method=method)[0]
    rows = [row[row < n] for row in plan]
    # The balanced plan may put a placeholder in any step, which left a short step in
    # the middle of the window; as documented, full steps come first and the short
    # ones last, longest first (a stable reorder of whole steps inside the window:
    # balance and the delay bound are unchanged).
    return sorted(rows, key=lambda row: -row.size)


def _step_loads(costs: np.ndarray, plan: np.ndarray) -> np.ndarray:
    b, w, k = plan.shape
    return np.take_along_axis(costs, plan.reshape(b, w * k), 1).reshape(b, w, k).sum(axis=2)


def _order_steps(parts: np.ndarray) -> np.ndarray:
    # Parts -> steps by mean arrival index: the plan is then close to arrival order,
    # so the average delay is small even though any order would meet the bound.
    key = parts.mean(axis=2)
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(parts, order[:, :, None], axis=1)


def _check_method(method: str) -> None:
    check_choice("method", method, METHODS)
