"""Readable specifications of the package's computations, for tests.

Slow on purpose: plain Python loops or PyTorch float64, no vectorisation tricks. The
fast numpy code elsewhere must agree with these (exactly, on integer-valued costs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = [
    "reference_budget_select",
    "reference_delays",
    "reference_optimal_makespan",
    "reference_sample_costs",
]


def reference_sample_costs(
    lengths: torch.Tensor, *, linear: float, quadratic: float, constant: float
) -> torch.Tensor:
    """``constant + linear * L + quadratic * L**2`` per sample, in float64."""
    lens = lengths.to(torch.float64)
    return constant + linear * lens + quadratic * lens * lens


def reference_delays(plan: Sequence[Sequence[int]], per_step: int) -> list[int]:
    """``trained step - natural step`` of every index in a window ``plan``."""
    return [s - i // per_step for s, step in enumerate(plan) for i in step]


def reference_optimal_makespan(costs: Sequence[float], num_parts: int) -> float:
    """Exact minimum over equal-size partitions of the largest part sum (brute force).

    For tiny inputs only (``len(costs) <= 12``): the oracle the heuristics are scored
    against in tests.
    """
    n = len(costs)
    if n % num_parts:
        raise ValueError("len(costs) must be a multiple of num_parts")
    if n > 12:
        raise ValueError("brute force is limited to 12 items")
    k = n // num_parts
    best = float("inf")

    def search(remaining: tuple[int, ...], current_max: float) -> None:
        nonlocal best
        if current_max >= best:
            return
        if not remaining:
            best = current_max
            return
        # The smallest remaining index anchors the next part: no part order duplicates.
        head, rest = remaining[0], remaining[1:]
        for others in itertools.combinations(rest, k - 1):
            part = (head, *others)
            load = sum(costs[i] for i in part)
            left = tuple(i for i in rest if i not in others)
            search(left, max(current_max, load))

    search(tuple(range(n)), 0.0)
    return best


def reference_budget_select(
    costs: Sequence[float],
    seqs: Sequence[int],
    forced: Sequence[bool],
    budget: float,
    *,
    swap_rounds: int = 2,
    swap_candidates: int = 16,
) -> set[int]:
    """One step of cost-budget batching for one buffer, written as plain loops.

    Returns the positions (into ``costs``) taken this step. Mirrors steps 2-5 of
    :mod:`hyperrec.bbs.budget`.
    """
    order = sorted(range(len(costs)), key=lambda i: seqs[i])  # oldest first
    taken = {i for i in order if forced[i]}
    total = 0.0
    for i in order:
        if i in taken:
            total += costs[i]
    for i in order:  # first fit, oldest first
        if i not in taken and total + costs[i] <= budget:
            taken.add(i)
            total += costs[i]
    for _ in range(swap_rounds):
        movable = [i for i in reversed(order) if i in taken and not forced[i]]
        waiting = [i for i in order if i not in taken]
        if not movable or not waiting or budget - total <= 0:
            break
        best = None
        for x in movable[:swap_candidates]:
            for y in waiting[:swap_candidates]:
                gain = costs[y] - costs[x]
                if gain > 0 and total + gain <= budget and (best is None or gain > best[0]):
                    best = (gain, x, y)
        if best is None:
            break
        gain, x, y = best
        taken.remove(x)
        taken.add(y)
        total += gain
    if not taken and order:
        taken.add(order[0])
    return taken
